"""`rolefleet up` with the actor over two worker processes (gloo on the CPU): a worker that dies
ends the run with a clear error instead of a hang. (A split actor's run that completes and leaves
nothing behind: tests/e2e/test_cluster.py.)"""

import os
import signal
import time

import pytest

from tests.e2e.procs import (
    children_of,
    descendants,
    processes_mentioning,
    rolefleet,
    running_run,
    write_config,
)

pytestmark = pytest.mark.e2e


def actor_pid(config_path: str) -> int:
    [pid] = [p for p in processes_mentioning("serve actor") if p in processes_mentioning(config_path)]
    return pid


def test_a_dead_worker_ends_its_role_and_the_run_clearly(make_config, tmp_path):
    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=2", "train.total_steps=100000", "actor.workers=2",
                      "run.max_restarts=0",  # GRPO: no critic process, which this test has no use for
                      # How long the coordinator's step waits for the lost actor to come back (300 s):
                      # `up`, stopping the run, gives it 20 s of that before a kill, all waited out here.
                      "train.connect_timeout_s=5")
    config = write_config(cfg, tmp_path / "config.yaml")
    resolved = str(cfg.run.out / "config.yaml")
    proc = rolefleet("up", str(config))
    try:
        address = running_run(proc, cfg.run.out / "metrics.jsonl")
        status = rolefleet("status", "--address", address, "--run", str(cfg.run.out))
        shown, _ = status.communicate(timeout=60)
        [row] = [line for line in shown.splitlines() if line.split()[:1] == ["actor"]]
        assert "2 workers" in row, shown
        # The spawned worker, not multiprocessing's resource tracker.
        [worker] = [c for c in children_of(actor_pid(resolved)) if c in processes_mentioning("spawn_main")]
        os.kill(worker, signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, output
    log = (cfg.run.out / "logs" / "actor.log").read_text()
    assert "actor: worker actor-rank1 exited with code -9; the role cannot continue without it" in log
    deadline = time.monotonic() + 30
    while (processes_mentioning(resolved) or descendants(proc)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(resolved) == [] and descendants(proc) == []
