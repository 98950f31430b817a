"""A role's worker group over several nodes, on one machine: `rolefleet up` runs the actor as two node
agents (torch's elastic agent, `launch.py`) of two gloo ranks each, joined by the c10d
rendezvous on loopback, the same path as a cluster. It trains like one process; a node agent killed
mid-run is recovered from; a node that never arrives ends the role with a rendezvous timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rolefleet.export import export_checkpoint
from tests.e2e.procs import descendants, processes_mentioning, read_metrics, rolefleet, running_run, write_config

# Two `rolefleet up` runs in one test (the single-process reference and the spanning run).
pytestmark = [pytest.mark.e2e, pytest.mark.multinode, pytest.mark.timeout(420)]

# Two steps of GRPO; the actor's first rank generates alone, so its samples are those of one process
# given the same weights (the other ranks train, FSDP2-sharded over both nodes).
RUN = ("algorithm=grpo", "train.total_steps=2", "train.prompts_per_step=8", "train.samples_per_prompt=2",
       "actor.entropy_coef=0.01",  # a gradient even in a step whose samples all score alike
       "checkpoint.every=2", "checkpoint.every_minutes=0")
SPAN = ("actor.workers=4", "actor.nodes=2", "actor.rollout.workers=1")


def run_up(cfg, config: Path, timeout: float = 240) -> str:
    proc = rolefleet("up", str(write_config(cfg, config)))
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    return output


def final_weights(cfg, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"export-{cfg.run.name}"
    export_checkpoint(cfg.run.out / "checkpoints" / "step-00000002", out, dtype="float32")
    return load_file(str(out / "model.safetensors"))


def single_process_weights(make_config, tmp_path: Path) -> dict[str, torch.Tensor]:
    cfg = make_config(*RUN, "run.name=single", f"run.output_dir={tmp_path / 'single'}")
    run_up(cfg, tmp_path / "single.yaml")
    return final_weights(cfg, tmp_path)


def test_an_actor_over_two_nodes_trains_to_the_weights_of_one_process(make_config, tmp_path, tiny_model_dir):
    """FSDP2 over both nodes (replicated training gives one process's step too: that the sharding
    does not change a step is tests/common/test_workers.py's, in one node's processes)."""
    reference = single_process_weights(make_config, tmp_path)
    cfg = make_config(*RUN, *SPAN, "actor.sharding=fsdp", "run.name=span",
                      f"run.output_dir={tmp_path / 'span'}")
    run_up(cfg, tmp_path / "span.yaml")
    logs = cfg.run.out / "logs"
    assert "actor: 4 worker processes joined (gloo) over 2 nodes" in (logs / "actor.log").read_text()
    node1 = (logs / "actor.node1.log").read_text()
    assert "actor: node 1 (node1, ranks 2-3) joining the rendezvous at 127.0.0.1:" in node1
    assert "actor: node 1 (node1, ranks 2-3): its ranks stopped" in node1  # an orderly stop, not a kill
    assert "exit barrier" not in node1  # every agent left together
    spanned = final_weights(cfg, tmp_path)
    initial = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    moved = max((reference[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3, "the run must move the weights for the comparison to mean anything"
    assert spanned.keys() == reference.keys()
    for name, tensor in reference.items():  # float32 sums in another order: close, not equal
        assert torch.allclose(spanned[name], tensor, atol=1e-4, rtol=1e-3), name
    assert [r["step"] for r in read_metrics(cfg.run.out / "metrics.jsonl")] == [1, 2]


def test_a_killed_node_process_ends_the_role_and_the_run_recovers(make_config, tmp_path):
    cfg = make_config("algorithm=grpo", "train.total_steps=4", "train.prompts_per_step=4",
                      "train.samples_per_prompt=2", "checkpoint.every=1", "run.max_restarts=2",
                      "actor.workers=2", "actor.nodes=2")  # one rank a node: the fewest processes that span
    config = write_config(cfg, tmp_path / "config.yaml")
    resolved = str(cfg.run.out / "config.yaml")
    proc = rolefleet("up", str(config))
    try:
        running_run(proc, cfg.run.out / "metrics.jsonl")
        [node1] = [p for p in processes_mentioning("--node-rank 1") if p in processes_mentioning(resolved)]
        os.kill(node1, signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "rolefleet: actor node 1 exited with code -9 during the run; restarting it" in output
    assert "(every process of actor: its group forms anew)" in output
    records = read_metrics(cfg.run.out / "metrics.jsonl")
    assert records[-1]["step"] == 4 and "ended FINISHED after step 4/4" in output
    # The group formed again: the server and node 1 both logged a second arrival.
    logs = cfg.run.out / "logs"
    assert (logs / "actor.log").read_text().count("joined (gloo) over 2 nodes") == 2
    assert (logs / "actor.node1.log").read_text().count("joining the rendezvous") == 2
    deadline = time.monotonic() + 30
    while (processes_mentioning(resolved) or descendants(proc)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(resolved) == [] and descendants(proc) == []


def serve(config: Path, *args: str, ready: Path | None = None) -> subprocess.Popen:
    extra = ["--ready-file", str(ready)] if ready else []
    return rolefleet("serve", "actor", "--config", str(config), *extra, *args)


def test_the_server_ends_the_role_naming_a_node_whose_process_died(make_config, tmp_path):
    """Without a supervisor (Kubernetes restarts pods itself): rank 0 sees node 1's rank go and ends
    the role naming the node; node 0's agent exits 1."""
    cfg = make_config("actor.workers=2", "actor.nodes=2", "actor.rendezvous.timeout_s=60",
                      "security.allow_unauthenticated=true")
    config = write_config(cfg, tmp_path / "config.yaml")
    port = ["actor.rendezvous.port=" + str(_free_port())]
    server = serve(config, *port, ready=tmp_path / "ready.json")
    node = serve(config, "--node-rank", "1", *port)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready.json").exists() and time.monotonic() < deadline:
            assert server.poll() is None and node.poll() is None
            time.sleep(0.2)
        node.send_signal(signal.SIGKILL)
        output, _ = server.communicate(timeout=60)
    finally:
        for p in (server, node):
            if p.poll() is None:
                p.kill()
    assert server.returncode == 1, output
    assert "actor: node 1 (node1, rank 1): rank 1's process is gone (" in output
    assert "; the role cannot continue without it" in output


def test_a_node_that_never_arrives_is_a_rendezvous_timeout_naming_it(make_config, tmp_path):
    cfg = make_config("actor.workers=4", "actor.nodes=2", "actor.rendezvous.timeout_s=3",
                      "security.allow_unauthenticated=true", f"actor.rendezvous.port={_free_port()}")
    config = write_config(cfg, tmp_path / "config.yaml")
    server = serve(config)
    output, _ = server.communicate(timeout=120)
    assert server.returncode == 1, output
    assert ("rolefleet: actor: rendezvous timed out after 3 s (actor.rendezvous.timeout_s) waiting at 127.0.0.1:"
            in output)
    assert "for the role's other 1 node(s): start `rolefleet serve actor --node-rank K` on each" in output
    assert "Traceback" not in output
    # The other way round: a node process whose first node never answers.
    node = serve(config, "--node-rank", "1")
    output, _ = node.communicate(timeout=120)
    assert node.returncode == 1, output
    assert "rolefleet: actor: node 1 (node1, ranks 2-3): the actor's first node did not answer at 127.0.0.1:" in output
    assert "within 3 s (actor.rendezvous.timeout_s)" in output
    # SIGTERM while it still waits for the other nodes ends it at once, not at the rendezvous timeout.
    patient = serve(config, "actor.rendezvous.timeout_s=120")
    seen = []
    for line in patient.stdout:  # signalled once it waits, not while it still imports (killed by then)
        seen.append(line)
        if "joining the rendezvous" in line:
            break
    waited = time.monotonic()
    patient.send_signal(signal.SIGTERM)
    rest, _ = patient.communicate(timeout=20)
    assert patient.returncode == 0, "".join(seen) + rest
    assert time.monotonic() - waited < 20
    bad = serve(config, "--node-rank", "2")
    output, _ = bad.communicate(timeout=120)
    assert bad.returncode == 1 and ("--node-rank 2: actor's worker group spans 2 nodes, so the node rank is 0 "
                                    "(the server process) to 1") in output


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Marker:
    """A pickle that, once loaded, makes a directory: the proof that a listener ran a caller's code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def listening_ports(pids: list[int]) -> set[int]:
    import psutil

    ports = set()
    for pid in pids:
        try:
            ports |= {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == "LISTEN"}
        except psutil.NoSuchProcess:
            pass
    return ports


def test_the_runs_token_makes_no_rank_run_anything_on_any_port_the_role_opens(make_config, tmp_path):
    """Every TCP port the processes of a spanning actor listen on (gRPC, metrics, the rendezvous and
    the agents' stores, gloo's) gets the run's token and a pickle that would run code if loaded, as the
    old command channel took them: nothing loads it, and the role still serves."""
    import asyncio
    import pickle
    import socket

    from rolefleet.actor.client import GrpcActorClient
    from rolefleet.common.config import SecuritySection
    from rolefleet.rpc.roles import use_security
    from rolefleet.rpc.security import Security

    token = tmp_path / "token"
    token.write_text("a-run-token-of-thirty-two-chars!\n")
    cfg = make_config("actor.workers=2", "actor.nodes=2", "actor.rendezvous.timeout_s=60",
                      f"security.token_file={token}", f"actor.rendezvous.port={_free_port()}")
    config = write_config(cfg, tmp_path / "config.yaml")
    server = serve(config, ready=tmp_path / "ready.json")
    node = serve(config, "--node-rank", "1")
    marker = tmp_path / "ran"
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready.json").exists() and time.monotonic() < deadline:
            assert server.poll() is None and node.poll() is None
            time.sleep(0.2)
        ports = listening_ports([server.pid, node.pid, *descendants(server), *descendants(node)])
        assert len(ports) >= 4  # gRPC, metrics, the rendezvous store, the agents' store (and gloo's)
        payload = pickle.dumps(_Marker(marker))
        for port in sorted(ports):
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(token.read_bytes() + pickle.dumps(("run", payload)) + payload)
                try:
                    s.recv(4096)
                except OSError:
                    pass
        time.sleep(2)
        assert not marker.exists(), "a listener of the role loaded a caller's pickle"
        use_security(Security.of(SecuritySection(token_file=str(token)), "client"))

        async def still_serving():
            import json

            port = json.loads((tmp_path / 'ready.json').read_text())['grpc_port']
            client = GrpcActorClient(f"127.0.0.1:{port}", timeout_s=30)
            try:
                return await client.status()
            finally:
                await client.close()

        assert asyncio.run(still_serving()).role == "actor"
        assert server.poll() is None and node.poll() is None
    finally:
        for p in (server, node):
            if p.poll() is None:
                p.kill()


def test_torchrun_itself_can_start_the_ranks_and_rank_0_serves(make_config, tmp_path):
    """A launcher of the user's (a PyTorchJob, `srun torchrun`) instead of our agent: each rank is
    `rolefleet serve` in torchrun's environment; rank 0 serves, and SIGTERM to torchrun stops them all."""
    import sys

    from tests.e2e.procs import LAUNCH

    cfg = make_config("actor.workers=2", "security.allow_unauthenticated=true")
    config = write_config(cfg, tmp_path / "config.yaml")
    ready = tmp_path / "ready.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **{LAUNCH: os.urandom(8).hex()})
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "rolefleet.cli", "--log-level", "info", "serve", "actor", "--config", str(config),
                             "--ready-file", str(ready)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    proc.rolefleet_launch = env[LAUNCH]
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        assert ready.exists()
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "actor: 2 worker processes joined (gloo)\n" in output
    assert "actor stopped" in output  # rank 0's orderly stop, which ended rank 1 (STOP)
    assert descendants(proc) == []
