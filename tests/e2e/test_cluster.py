"""End to end: the four role servers as real processes on loopback, two PPO steps, clean shutdown."""

import asyncio
import signal
import time

import pytest

from rolefleet.actor.client import GrpcActorClient
from rolefleet.critic.client import GrpcCriticClient
from rolefleet.reward.client import GrpcRewardClient
from rolefleet.rpc.roles import fetch_status
from tests.e2e.procs import (
    counter,
    descendants,
    processes_mentioning,
    read_metrics,
    rolefleet,
    terminate,
    wait_ready,
    write_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


async def statuses(addresses):
    clients = [GrpcActorClient(addresses["actor"], 30), GrpcCriticClient(addresses["critic"], 30),
               GrpcRewardClient(addresses["reward"], 30)]
    try:
        return [await c.status(include_digest=True) for c in clients]
    finally:
        for c in clients:
            await c.close()


def test_role_servers_two_ppo_steps_with_two_reward_replicas(make_config, tmp_path):
    """Five real servers (actor, critic, two reward replicas) and `rolefleet train`: two PPO steps,
    both reward replicas scoring a share of them (`reward.replicas`)."""
    cfg = make_config("train.total_steps=2", "train.prompts_per_step=8")
    config = write_config(cfg, tmp_path / "config.yaml")
    servers, ports = {}, {}
    try:
        for name in ("actor", "reward", "reward2", "critic"):
            servers[name] = rolefleet("serve", name.rstrip("2"), "--config", str(config), "--ready-file",
                                      str(tmp_path / f"{name}.json"))
        for name, proc in servers.items():
            ports[name] = wait_ready(proc, tmp_path / f"{name}.json")
        addresses = {name: f"127.0.0.1:{p['grpc_port']}" for name, p in ports.items()}
        actor0, critic0, _ = asyncio.run(statuses(addresses))

        coordinator = rolefleet("train", str(config), f"actor.address={addresses['actor']}",
                                f"critic.address={addresses['critic']}",
                                f"reward.replicas=[{addresses['reward']}, {addresses['reward2']}]")
        output, _ = coordinator.communicate(timeout=240)
        assert coordinator.returncode == 0, output

        actor1, critic1, reward1 = asyncio.run(statuses(addresses))
        # The actor trained twice: new weights, policy version 0 -> 2, steps 1 and 2 applied.
        assert actor1.weights_digest != actor0.weights_digest
        assert (actor0.model_version, actor1.model_version, actor1.last_step) == (0, 2, 2)
        # The critic trained twice too.
        assert critic1.weights_digest != critic0.weights_digest and critic1.model_version == 2
        # Rewards came from the two reward servers: each scored a share, together every sample.
        scored = [counter(ports[name]["metrics_port"], "rolefleet_samples_scored", role="reward")
                  for name in ("reward", "reward2")]
        # (A shard re-sent to the other replica when its own lagged, on a loaded machine, is scored twice.)
        hedged = "hedging" in output
        assert all(n > 0 for n in scored) and (sum(scored) >= 2 * 8 if hedged else sum(scored) == 2 * 8), scored
        records = read_metrics(cfg.run.out / "metrics.jsonl")
        assert [r["policy_version"] for r in records] == [1, 2]
    finally:
        codes = {name: terminate(proc) for name, proc in servers.items()}
    assert codes == {"actor": 0, "reward": 0, "reward2": 0, "critic": 0}  # ordered shutdown on SIGTERM, exit 0
    assert processes_mentioning(str(config)) == []


def test_up_runs_a_split_cluster_in_async_mode_within_the_bound_and_leaves_no_process(make_config, tmp_path):
    """`rolefleet up` starts the four roles and stops them all, worker processes included. The
    actor's rank 0 generates while rank 1 trains (the critic trains on two workers), in async mode:
    samples stream over gRPC in chunks, each update's weights reach the generating worker, and the
    actor's Update takes batches one version behind (the bound `up` hands it from the config). The
    run completes with its curve and one log per role server. (Sync mode through `up`: the live-run,
    chaos and auth tests.)"""
    cfg = make_config("train.total_steps=4", "pipeline.mode=async", "pipeline.max_staleness=1",
                      "actor.rollout.batch_size=4", "actor.workers=2", "actor.rollout.workers=1", "critic.workers=2")
    config = write_config(cfg, tmp_path / "config.yaml")
    proc = rolefleet("up", str(config))
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    out = cfg.run.out
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["policy_version"] == 4
    # Generation ran one batch ahead: from the second step on, each batch is one version behind.
    assert [r["pipeline/version_lag/max"] for r in records] == [0, 1, 1, 1]
    assert {"busy/actor", "busy/reward", "busy/critic"} <= set(records[-1])
    assert (out / "reward_curve.png").exists()
    assert {p.name for p in (out / "logs").iterdir()} == {"actor.log", "reward.log", "critic.log"}
    log = (out / "logs" / "actor.log").read_text()
    assert "actor serving gRPC" in log and "actor: 2 worker processes joined (gloo)" in log
    assert "actor placement: 1 training workers (ranks [1]), 1 rollout workers (ranks [0])" in log
    assert processes_mentioning(str(out / "config.yaml")) == []
    deadline = time.monotonic() + 10  # the worker processes are gone too (and multiprocessing's tracker,
    while descendants(proc) and time.monotonic() < deadline:  # which ends once it reads its parent's exit)
        time.sleep(0.2)
    assert descendants(proc) == []


def test_train_without_role_servers_fails_clearly(make_config, tmp_path):
    cfg = make_config("train.connect_timeout_s=1", "actor.address=127.0.0.1:1", "reward.address=127.0.0.1:1",
                      "critic.address=127.0.0.1:1")
    proc = rolefleet("train", str(write_config(cfg, tmp_path / "config.yaml")))
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "actor at 127.0.0.1:1 was not SERVING within 1s" in output


def test_up_of_grpo_with_partial_rollouts_runs_without_a_critic_and_carries_responses(make_config, tmp_path):
    """A critic-free algorithm starts no critic server and logs no critic metric; responses cut at a
    1-token budget are resumed over gRPC in the next step (Continuation.resume_from), trained within
    the bound the actor is handed, each sample once; the KL loss and the IS correction are on."""
    from rolefleet.coordinator.journal import FILENAME, Journal

    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=4", "train.prompts_per_step=4",
                      "train.total_steps=4", "pipeline.partial_rollouts.enabled=true",
                      "pipeline.partial_rollouts.token_budget=1", "pipeline.max_staleness=3",
                      "actor.kl_loss_coef=0.01", "actor.is_correction=token_truncate",
                      # Lengths spread over the cap (the warm-started answers are 2-3 tokens, which
                      # could end every group in the same round): groups finish in different steps.
                      "sampling.temperature=2.0", "sampling.max_new_tokens=6")
    config = write_config(cfg, tmp_path / "config.yaml")
    proc = rolefleet("up", str(config))
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    out = cfg.run.out
    assert {p.name for p in (out / "logs").iterdir()} == {"actor.log", "reward.log"}  # no critic started
    records = read_metrics(out / "metrics.jsonl")
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4]
    assert not any(key.startswith("critic/") or key.startswith("value/") for r in records for key in r)
    assert {"actor/kl_loss", "actor/is_weight_mean", "kl_coef"} <= set(records[0])
    assert max(r["partial/max_lag"] for r in records) > 0  # carried responses were trained later
    assert all(r["partial/max_lag"] <= 3 for r in records)
    with Journal(out / FILENAME) as journal:
        trained = journal.trained_sample_ids()
    assert len(trained) == len(set(trained)) == 4 * sum(r["partial/trained_groups"] for r in records)
    assert processes_mentioning(str(out / "config.yaml")) == []


def test_sigterm_while_connecting_stops_the_coordinator_at_once(make_config, tmp_path):
    cfg = make_config("actor.address=127.0.0.1:1", "reward.address=127.0.0.1:1", "critic.address=127.0.0.1:1")
    proc = rolefleet("train", str(write_config(cfg, tmp_path / "config.yaml")))
    deadline = time.monotonic() + 60
    line = ""
    while "shows its progress" not in line:  # the control service is up; roles are not
        assert time.monotonic() < deadline and proc.poll() is None
        line = proc.stdout.readline()
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 1  # did not finish the run
    assert time.monotonic() - started < 15  # not the 300 s connect timeout


def test_train_without_role_addresses_is_a_config_error(make_config, tmp_path):
    proc = rolefleet("train", str(write_config(make_config(), tmp_path / "config.yaml")))
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "set actor.address" in output


def test_up_with_a_missing_model_says_why_before_starting_anything(make_config, tmp_path):
    cfg = make_config(f"model.model_name_or_path={tmp_path / 'no-such-model'}")
    proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in output, output
    assert "actor.model_name_or_path" in output and "no-such-model does not exist" in output
    assert not (cfg.run.out / "logs").exists()  # nothing was started


def test_up_shows_the_log_of_a_role_that_dies_before_it_is_ready(make_config, tmp_path, tiny_model_dir):
    import shutil

    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()  # passes the config check (config.json is there); fails when the actor loads it
    cfg = make_config(f"model.model_name_or_path={broken}")
    proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "exited with code 1 before it was ready" in output and "no-weights" in output
    assert processes_mentioning(str(cfg.run.out / "config.yaml")) == []


def test_up_refuses_to_train_a_stale_server_on_its_port(make_config, tmp_path):
    """A role server left from another run holds the configured actor port: `up` must not start a
    run against it (it used to train that stale actor and exit 0)."""
    stale_cfg = make_config("run.name=stale", f"run.output_dir={tmp_path / 'stale'}")
    stale_config = write_config(stale_cfg, tmp_path / "stale.yaml")
    stale = rolefleet("serve", "actor", "--config", str(stale_config), "--ready-file", str(tmp_path / "stale.json"))
    try:
        port = wait_ready(stale, tmp_path / "stale.json")["grpc_port"]
        address = f"127.0.0.1:{port}"
        before = asyncio.run(fetch_status("actor", address, 30, include_digest=True))
        cfg = make_config(f"actor.port={port}")
        proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1, output
        assert f"cannot listen for gRPC on 127.0.0.1:{port}" in output and "Traceback" not in output
        assert not (cfg.run.out / "metrics.jsonl").exists()  # no run started
        after = asyncio.run(fetch_status("actor", address, 30, include_digest=True))  # untouched, still up
        assert (after.instance_id, after.last_step, after.weights_digest) == \
            (before.instance_id, 0, before.weights_digest)
        assert processes_mentioning(str(cfg.run.out / "config.yaml")) == []
    finally:
        terminate(stale)
