"""Two reward replicas (real `serve reward` processes) both receive work in one run of the
coordinator (`rolefleet train` with `reward.replicas`), and the run sees every sample scored."""

import pytest

from tests.e2e.procs import read_metrics, rolefleet, terminate, wait_ready, write_config
from tests.e2e.test_cluster import scored_samples

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_two_reward_replicas_both_score(make_config, tmp_path):
    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=2", "train.total_steps=2",
                      "train.prompts_per_step=8")
    config = write_config(cfg, tmp_path / "config.yaml")
    servers, ports = {}, {}
    try:
        for name, role in (("actor", "actor"), ("reward1", "reward"), ("reward2", "reward")):
            servers[name] = rolefleet("serve", role, "--config", str(config), "--ready-file",
                                      str(tmp_path / f"{name}.json"))
        for name, proc in servers.items():
            ports[name] = wait_ready(proc, tmp_path / f"{name}.json")
        replicas = [f"127.0.0.1:{ports[n]['grpc_port']}" for n in ("reward1", "reward2")]
        coordinator = rolefleet("train", str(config), f"actor.address=127.0.0.1:{ports['actor']['grpc_port']}",
                                f"reward.replicas=[{', '.join(replicas)}]")
        output, _ = coordinator.communicate(timeout=240)
        assert coordinator.returncode == 0, output
        scored = [scored_samples(ports[n]["metrics_port"]) for n in ("reward1", "reward2")]
        assert all(s > 0 for s in scored) and sum(scored) == 2 * 8 * 2, scored
        assert [r["step"] for r in read_metrics(cfg.run.out / "metrics.jsonl")] == [1, 2]
    finally:
        for proc in servers.values():
            terminate(proc)
