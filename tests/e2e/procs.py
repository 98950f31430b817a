"""Launching real role processes for end-to-end tests (loopback, ephemeral ports, bounded waits)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

READY_TIMEOUT_S = 120


def write_config(cfg, path: Path) -> Path:
    from rolefleet.common.config import dump_config

    path.write_text(dump_config(cfg))
    return path


LAUNCH = "ROLEFLEET_TEST_LAUNCH"  # in the environment of a `rolefleet` a test starts, and of its descendants


def rolefleet(*args: str, **kwargs) -> subprocess.Popen:
    """`rolefleet ARGS`; its process tree carries a launch id of its own (`descendants`)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **{LAUNCH: os.urandom(8).hex()})
    proc = subprocess.Popen([sys.executable, "-m", "rolefleet.cli", "--log-level", "info", *args], env=env,
                            stdout=kwargs.pop("stdout", subprocess.PIPE), stderr=subprocess.STDOUT, text=True,
                            **kwargs)
    proc.rolefleet_launch = env[LAUNCH]
    return proc


def wait_ready(proc: subprocess.Popen, ready: Path) -> dict:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited early with {proc.returncode}:\n{proc.stdout.read()}")
        if ready.exists():
            return json.loads(ready.read_text())
        time.sleep(0.1)
    raise AssertionError(f"not ready within {READY_TIMEOUT_S}s")


def terminate(proc: subprocess.Popen, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("process ignored SIGTERM") from None


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains `text` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def descendants(proc: subprocess.Popen) -> list[int]:
    """Live processes started under `proc` (at any depth, reparented or not): those whose
    environment carries its launch id. Another test's processes (a second test process of
    `make test`) never match, as a command-line pattern might."""
    mark = f"{LAUNCH}={proc.rolefleet_launch}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), proc.pid):
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def bearer(run_dir: Path) -> dict[str, str]:
    """The header that presents the token `rolefleet up` made for the run in `run_dir`."""
    return {"Authorization": f"Bearer {(run_dir / 'token').read_text().strip()}"}


def counter(metrics_port: int | str, name: str, **labels: str) -> float:
    """The total of Prometheus counter `name` over its samples with these labels, as the role
    serving /metrics on `metrics_port` shows it now (0 before its first count)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    family = families.get(name)
    return sum(s.value for s in family.samples if s.name.endswith("_total")
               and all(s.labels.get(k) == v for k, v in labels.items())) if family else 0.0


def read_metrics(path: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, read while the run may be writing it: its complete lines
    (each record ends with a newline; the text after the last one is a record still being written)."""
    complete = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def running_run(proc: subprocess.Popen, metrics: Path, timeout_s: float = 180) -> str:
    """Wait until a `rolefleet up` prints its status address and logs its first step; returns the
    coordinator's address."""
    return _started(proc, metrics, timeout_s).split("--address ")[1].split("`")[0]


def running_run_http(proc: subprocess.Popen, metrics: Path, timeout_s: float = 180) -> str:
    """As `running_run`; returns the URL of the coordinator's HTTP control plane."""
    return _started(proc, metrics, timeout_s).split("HTTP control plane on ")[1].split()[0]


def running_run_both(proc: subprocess.Popen, metrics: Path, timeout_s: float = 180) -> tuple[str, str]:
    """As `running_run`; returns the coordinator's gRPC address and its control plane's URL."""
    line = _started(proc, metrics, timeout_s)
    return line.split("--address ")[1].split("`")[0], line.split("HTTP control plane on ")[1].split()[0]


def _started(proc: subprocess.Popen, metrics: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    line = ""
    while "shows its progress" not in line:
        assert time.monotonic() < deadline and proc.poll() is None
        line = proc.stdout.readline()
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else ""
        time.sleep(0.2)
    return line




def gone(pid: int, timeout_s: float = 0.0) -> bool:
    """Whether `pid` has ended (or is a zombie waiting for its new parent to reap it) within
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    """PIDs of the live child processes of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found
