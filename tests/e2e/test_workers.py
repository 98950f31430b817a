"""`rolefleet up` with the actor over two worker processes (gloo on the CPU): a run completes and
leaves nothing behind; a worker that dies ends the run with a clear error instead of a hang."""

import os
import signal
import time

import pytest

from tests.e2e.procs import (
    children_of,
    descendants,
    processes_mentioning,
    read_metrics,
    rolefleet,
    running_run,
    write_config,
)

pytestmark = pytest.mark.e2e


def actor_pid(config_path: str) -> int:
    [pid] = [p for p in processes_mentioning("serve actor") if p in processes_mentioning(config_path)]
    return pid


def test_up_with_a_split_actor_trains_async_and_leaves_no_process(make_config, tmp_path):
    """The actor's rank 0 generates while rank 1 trains, in async mode; each update's weights reach
    the generating worker (the policy version moves with them)."""
    cfg = make_config("train.total_steps=3", "actor.workers=2", "actor.rollout.workers=1", "critic.workers=2",
                      "pipeline.mode=async", "pipeline.max_staleness=1")
    config = write_config(cfg, tmp_path / "config.yaml")
    proc = rolefleet("up", str(config))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    records = read_metrics(cfg.run.out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["policy_version"] == 3
    # Step 3 trains samples of version 1 or 2: generated after an update reached the rollout worker.
    assert records[-1]["pipeline/version_lag/max"] <= 1
    log = (cfg.run.out / "logs" / "actor.log").read_text()
    assert "actor: 2 worker processes joined (gloo)" in log
    assert "actor placement: 1 training workers (ranks [1]), 1 rollout workers (ranks [0])" in log
    assert processes_mentioning(str(cfg.run.out / "config.yaml")) == []
    deadline = time.monotonic() + 10  # the worker processes are gone too (and multiprocessing's tracker,
    while descendants(proc) and time.monotonic() < deadline:  # which ends once it reads its parent's exit)
        time.sleep(0.2)
    assert descendants(proc) == []


def test_a_dead_worker_ends_its_role_and_the_run_clearly(make_config, tmp_path):
    cfg = make_config("train.total_steps=100000", "actor.workers=2", "run.max_restarts=0")
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
