"""One running `rolefleet up` (four role processes, default security) driven the ways a user drives
a run: the token `up` makes for it (forged calls refused, `rolefleet status --run` presents it), the
status command's role map, the HTTP control plane (status, roles, steps, pause, resume), a reward
replica added and removed (`rolefleet scale`), and SIGTERM, which stops every role in order.

These checks share one run because each needs a run in progress and nothing more: starting the
four role processes is most of what each would cost on its own."""

import asyncio
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from rolefleet.common.pb import actor_pb2, actor_pb2_grpc
from rolefleet.coordinator.journal import Journal
from tests.e2e.procs import (
    bearer,
    counter,
    processes_mentioning,
    read_metrics,
    rolefleet,
    running_run_both,
    wait_ready,
    write_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STEPS = 1_000_000
REQUIRED_KEYS = {"step", "policy_version", "reward/mean", "kl", "timing/step_s", "throughput/tokens_per_s"}


def call(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> dict:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.load(reply)


def wait_for(predicate, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def scored(metrics_port) -> float:
    return counter(metrics_port, "rolefleet_samples_scored", role="reward")


def cli(*args: str) -> tuple[int, str]:
    proc = rolefleet(*args)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def test_a_running_run_under_its_own_token_status_http_scaling_and_sigterm(make_config, tmp_path, monkeypatch):
    monkeypatch.delenv("ROLEFLEET_TOKEN", raising=False)
    # Steps of this run take tens of milliseconds: enough of them that it is still running when the
    # last check is done, however slowly the CLI calls go on a loaded machine (SIGTERM ends it).
    cfg = make_config(f"train.total_steps={STEPS}", "checkpoint.at_end=false", "checkpoint.every_minutes=0")
    out, metrics = cfg.run.out, cfg.run.out / "metrics.jsonl"
    proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
    extra = None
    try:
        printed = ""
        while "rolefleet status --run" not in printed:  # what `up` says before the coordinator starts
            assert proc.poll() is None, proc.stdout.read()
            printed = proc.stdout.readline()
        assert f"the run's token, made for this run in {out / 'token'} (readable by you alone)" in printed
        address, url = running_run_both(proc, metrics)
        check_the_token(out)
        check_status(out, address)
        check_the_http_control_plane(out, url, metrics)
        extra = check_scaling(cfg, url, metrics, tmp_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            for p in (proc, extra):
                if p is not None and p.poll() is None:
                    p.kill()
    check_the_stop(cfg, proc.stdout.read(), metrics)


def check_the_token(out: Path) -> None:
    """No security keys and no ROLEFLEET_TOKEN: `up` made a token only its user reads, every role
    demands it, and forged Update calls are refused before any handler runs."""
    token_file = out / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600 and len(token_file.read_text().strip()) >= 32
    actor = (out / "logs" / "actor.log").read_text().split("serving gRPC on 127.0.0.1:")[1]
    actor, metrics_port = "127.0.0.1:" + actor.split(",")[0], actor.split("metrics on :")[1].split()[0]

    async def forge(metadata=()) -> list[grpc.StatusCode]:
        """30 Update calls as a local process without the token would send them."""
        async with grpc.aio.insecure_channel(actor) as channel:
            stub = actor_pb2_grpc.ActorServiceStub(channel)
            codes = []
            for _ in range(30):
                try:
                    await stub.Update(actor_pb2.ActorUpdateRequest(), metadata=metadata, timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            return codes

    def refused() -> float:
        return counter(metrics_port, "rolefleet_auth_refused", role="actor", reason="missing")

    before = refused()
    assert asyncio.run(forge()) == [grpc.StatusCode.UNAUTHENTICATED] * 30
    wrong = (("authorization", "Bearer not-the-token-0123456789"),)
    assert asyncio.run(forge(wrong)) == [grpc.StatusCode.UNAUTHENTICATED] * 30
    assert refused() - before == 30  # each tokenless call counted, none handled


def check_status(out: Path, address: str) -> None:
    """`rolefleet status --run DIR` finds the run's address and token in its directory and shows
    the role map (each role's address, its GPUs: none on the CPU, its workers); without the token
    the coordinator refuses and the message says where the token is found."""
    code, shown = cli("status", "--run", str(out))
    assert code == 0 and "run test: RUNNING, step " in shown and f"/{STEPS}" in shown, shown
    assert json.loads((out / "coordinator.json").read_text())["address"] == address
    for role in ("actor", "reward", "critic"):
        [row] = [line for line in shown.splitlines() if line.split()[:1] == [role]]
        assert "127.0.0.1:" in row and "no GPU, 1 worker" in row, shown
        assert ("rollout engine hf" in row) == (role == "actor"), shown  # what backend auto chose
    assert len(processes_mentioning(str(out / "config.yaml"))) == 4
    code, denied = cli("status", "--address", address)
    assert code == 1 and "UNAUTHENTICATED" in denied and "--run DIR" in denied, denied


def check_the_http_control_plane(out: Path, url: str, metrics: Path) -> None:
    """The role map with each role's health, the step history as metrics.jsonl holds it, `status
    --http`, and pause (the step in flight ends, then no step starts) and resume."""
    assert url.startswith("http://127.0.0.1:")  # loopback unless configured
    with pytest.raises(urllib.error.HTTPError) as refused:  # the token `up` made for the run
        call(f"{url}/v1/status")
    assert refused.value.code == 401
    auth = bearer(out)
    status = call(f"{url}/v1/status", headers=auth)
    assert status["run_name"] == "test" and status["state"] == "RUNNING" and status["total_steps"] == STEPS
    roles = {r["role"]: r for r in call(f"{url}/v1/roles", headers=auth)}
    assert set(roles) == {"actor", "reward", "critic"}
    for r in roles.values():
        assert r["health"] == "SERVING" and r["devices"] == "" and r["workers"] == 1, r
        assert r["address"].startswith("127.0.0.1:") and r["engine"] == ("hf" if r["role"] == "actor" else ""), r
    page = call(f"{url}/v1/steps?since=0&limit=1", headers=auth)
    assert [r["step"] for r in page["steps"]] == [1] and page["next_since"] == 1
    assert page["steps"][0] == read_metrics(metrics)[0]

    code, text = cli("status", "--http", url, "--run", str(out))
    assert code == 0 and "run test: " in text and f"/{STEPS}" in text, text
    assert sum(1 for line in text.splitlines() if "no GPU, 1 worker" in line) == 3, text

    assert call(f"{url}/v1/pause", "POST", auth)["state"] == "PAUSED"
    held = settled(metrics)  # the step in flight ended
    time.sleep(2.0)
    assert len(read_metrics(metrics)) == held and call(f"{url}/v1/status", headers=auth)["step"] == held
    assert call(f"{url}/v1/resume", "POST", auth)["state"] == "RUNNING"
    wait_for(lambda: len(read_metrics(metrics)) > held + 2)


def settled(metrics: Path, within_s: float = 60) -> int:
    """The number of step records once none was added for three of the run's longest steps (at
    least 2 s: the machine may be loaded); AssertionError if that does not happen `within_s`."""
    deadline = time.monotonic() + within_s
    records = read_metrics(metrics)
    quiet_s = max(2.0, 3 * max(r.get("timing/step_s", 0.0) for r in records))
    count, since = len(records), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"steps still logged {within_s:.0f} s after the pause"
        time.sleep(0.2)
        if (now := len(read_metrics(metrics))) != count:
            count, since = now, time.monotonic()
    return count


def check_scaling(cfg, url: str, metrics: Path, tmp_path: Path) -> subprocess.Popen:
    """`rolefleet scale reward`: an added replica gets work at once; a removed one gets no new work
    and the run goes on without it; an address that does not answer, one in use and one not in use
    are refused. Returns the extra replica's process (stopped by then)."""
    ready = tmp_path / "extra.ready.json"
    extra = rolefleet("serve", "reward", "--config", str(cfg.run.out / "config.yaml"), "--ready-file", str(ready),
                      stdout=subprocess.DEVNULL)
    ports = wait_ready(extra, ready)
    address = f"127.0.0.1:{ports['grpc_port']}"
    run = ("--run", str(cfg.run.out))

    code, out = cli("scale", "reward", "--add", address, *run)  # the control plane's URL from the run's directory
    assert code == 0 and out.strip().endswith(f", {address}"), out
    wait_for(lambda: scored(ports["metrics_port"]) > 0)  # the next batches are shared with it
    code, out = cli("scale", "reward", "--add", "127.0.0.1:1", "--http", url, *run)  # nothing listens there
    assert code == 1 and "reward replica 127.0.0.1:1 does not answer" in out, out
    code, out = cli("scale", "reward", "--add", address, "--http", url, *run)
    assert code == 1 and f"reward replica {address} is already in use" in out, out

    code, out = cli("scale", "reward", "--remove", address, "--http", url, *run)
    assert code == 0 and address not in out, out
    step = len(read_metrics(metrics))
    wait_for(lambda: len(read_metrics(metrics)) >= step + 2)
    served = scored(ports["metrics_port"])  # its calls in flight at the removal are done by now
    wait_for(lambda: len(read_metrics(metrics)) >= step + 5)
    assert scored(ports["metrics_port"]) == served  # no new work after its removal
    extra.send_signal(signal.SIGTERM)
    extra.wait(timeout=60)
    wait_for(lambda: len(read_metrics(metrics)) >= step + 6)  # the run goes on without it
    code, out = cli("scale", "reward", "--remove", address, "--http", url, *run)
    assert code == 1 and f"no reward replica {address} in use" in out, out
    return extra


def check_the_stop(cfg, rest: str, metrics: Path) -> None:
    """SIGTERM to `up`: the coordinator was stopped first and finished its step while the roles
    still answered, so the run ended STOPPED with that step's complete record, every sample trained
    once (the replica's share included), and no process of the run is left."""
    assert "run failed" not in rest, rest
    ended = [line for line in rest.splitlines() if "rolefleet: run test ended " in line]
    assert len(ended) == 1 and "ended STOPPED after step " in ended[0], rest
    last_step = int(ended[0].split("after step ")[1].split("/")[0])
    records = read_metrics(metrics)
    assert last_step >= 1 and [r["step"] for r in records] == list(range(1, last_step + 1))
    assert REQUIRED_KEYS <= set(records[-1])
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        ids = journal.trained_sample_ids()
    assert len(ids) == len(set(ids)) == len(records) * cfg.train.prompts_per_step * cfg.train.samples_per_prompt
    resolved = str(cfg.run.out / "config.yaml")
    wait_for(lambda: not processes_mentioning(resolved), timeout_s=30)
