"""The HTTP control plane of a real run (`rolefleet up`, four role processes): the role map with
each role's health, the step history, pause (no step starts), resume, stop; `rolefleet status --http`."""

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.procs import bearer, read_metrics, rolefleet, running_run_http, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def call(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> dict:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.load(reply)


def wait_for(predicate, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_http_control_plane_drives_a_running_run(make_config, tmp_path):
    cfg = make_config("train.total_steps=1000")
    proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
    metrics = cfg.run.out / "metrics.jsonl"
    try:
        url = running_run_http(proc, metrics)
        assert url.startswith("http://127.0.0.1:")  # loopback unless configured
        with pytest.raises(urllib.error.HTTPError) as refused:  # the token `up` made for the run
            call(f"{url}/v1/status")
        assert refused.value.code == 401
        auth = bearer(cfg.run.out)
        status = call(f"{url}/v1/status", headers=auth)
        assert status["run_name"] == "test" and status["state"] == "RUNNING" and status["total_steps"] == 1000

        roles = {r["role"]: r for r in call(f"{url}/v1/roles", headers=auth)}
        assert set(roles) == {"actor", "reward", "critic"}
        for r in roles.values():
            assert r["health"] == "SERVING" and r["devices"] == "" and r["workers"] == 1, r
            assert r["address"].startswith("127.0.0.1:")

        page = call(f"{url}/v1/steps?since=0&limit=1", headers=auth)
        assert [r["step"] for r in page["steps"]] == [1] and page["next_since"] == 1
        assert page["steps"][0] == read_metrics(metrics)[0]  # the record metrics.jsonl holds

        out = rolefleet("status", "--http", url, "--run", str(cfg.run.out))
        text, _ = out.communicate(timeout=60)
        assert out.returncode == 0 and "run test: " in text and "/1000" in text, text
        assert sum(1 for line in text.splitlines() if "no GPU, 1 worker" in line) == 3, text

        # Pause: the step in flight ends, then no step starts.
        assert call(f"{url}/v1/pause", "POST", auth)["state"] == "PAUSED"
        time.sleep(1.0)
        held = len(read_metrics(metrics))
        time.sleep(2.0)  # a CPU step of this run takes well under a second
        assert len(read_metrics(metrics)) == held and call(f"{url}/v1/status", headers=auth)["step"] == held

        assert call(f"{url}/v1/resume", "POST", auth)["state"] == "RUNNING"
        wait_for(lambda: len(read_metrics(metrics)) > held + 2)

        assert call(f"{url}/v1/stop", "POST", auth)["state"] == "STOPPING"
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rest = proc.stdout.read()
    assert "ended STOPPED after step " in rest, rest
    with pytest.raises(urllib.error.URLError):  # the control plane went with its coordinator
        call(f"{url}/v1/status")
