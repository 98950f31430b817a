"""Reward replicas added to and removed from a running `rolefleet up` run (`rolefleet scale`): an
added replica gets work at once; a removed one gets no new work, and the run loses no sample."""

import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from rolefleet.coordinator.journal import Journal
from tests.e2e.procs import bearer, read_metrics, rolefleet, running_run_http, wait_ready, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def scored(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    match = re.search(r'^rolefleet_samples_scored_total\{role="reward"\} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def scale(run_dir: Path, *args: str) -> tuple[int, str]:
    """`rolefleet scale reward ARGS` with the token `up` made in `run_dir`."""
    proc = rolefleet("scale", "reward", *args, "--run", str(run_dir))
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def wait_for(predicate, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_reward_replica_added_mid_run_gets_work_and_one_removed_loses_none(make_config, tmp_path):
    cfg = make_config("train.total_steps=1000", "checkpoint.at_end=false")
    proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
    metrics = cfg.run.out / "metrics.jsonl"
    extra = None
    try:
        url = running_run_http(proc, metrics)
        ready = tmp_path / "extra.ready.json"
        extra = rolefleet("serve", "reward", "--config", str(cfg.run.out / "config.yaml"), "--ready-file", str(ready),
                          stdout=subprocess.DEVNULL)
        ports = wait_ready(extra, ready)
        address = f"127.0.0.1:{ports['grpc_port']}"

        code, out = scale(cfg.run.out, "--add", address)  # the control plane's URL from the run's directory
        assert code == 0 and out.strip().endswith(f", {address}"), out
        wait_for(lambda: scored(ports["metrics_port"]) > 0)  # the next batches are shared with it

        code, out = scale(cfg.run.out, "--add", "127.0.0.1:1", "--http", url)  # nothing listens there
        assert code == 1 and "reward replica 127.0.0.1:1 does not answer" in out, out
        code, out = scale(cfg.run.out, "--add", address, "--http", url)
        assert code == 1 and f"reward replica {address} is already in use" in out, out

        code, out = scale(cfg.run.out, "--remove", address, "--http", url)
        assert code == 0 and address not in out, out
        step = len(read_metrics(metrics))
        wait_for(lambda: len(read_metrics(metrics)) >= step + 2)
        served = scored(ports["metrics_port"])  # its calls in flight at the removal are done by now
        wait_for(lambda: len(read_metrics(metrics)) >= step + 5)
        assert scored(ports["metrics_port"]) == served  # no new work after its removal
        extra.send_signal(signal.SIGTERM)
        extra.wait(timeout=60)
        wait_for(lambda: len(read_metrics(metrics)) >= step + 6)  # the run goes on without it

        code, out = scale(cfg.run.out, "--remove", address, "--http", url)
        assert code == 1 and f"no reward replica {address} in use" in out, out
        urllib.request.urlopen(urllib.request.Request(f"{url}/v1/stop", method="POST", headers=bearer(cfg.run.out)),
                               timeout=10).read()
        output, _ = proc.communicate(timeout=120)
    finally:
        for p in (proc, extra):
            if p is not None and p.poll() is None:
                p.kill()
    assert proc.returncode == 0, output
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        ids = journal.trained_sample_ids()
    assert len(ids) == len(set(ids)) == len(records) * cfg.train.prompts_per_step * cfg.train.samples_per_prompt
