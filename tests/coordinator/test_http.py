"""The HTTP control plane served by uvicorn on a loopback port, over a run status the test drives:
every endpoint's answers and errors, and schemathesis fuzzing it against its own OpenAPI schema."""

import asyncio
import json
import subprocess
import threading
import urllib.error
import urllib.request

import pytest

from rolefleet.coordinator.http import HttpControlPlane, make_app
from rolefleet.coordinator.state import RunState, RunStatus
from tests.deploy.tools import tool

pytestmark = pytest.mark.timeout(180)


class Served:
    """The control plane on its own event loop in a thread, as the coordinator serves it."""

    def __init__(self, addresses: dict[str, str]):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            self.status = RunStatus(run_name="fuzz", total_steps=10)
            return HttpControlPlane(make_app(self.status, addresses), "127.0.0.1", 0)

        self.plane = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.plane.port}"

    def call(self, method: str, path: str) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, json.load(reply)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.plane.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def served():
    s = Served({"reward": "127.0.0.1:1"})  # nothing listens there: the role is UNREACHABLE
    yield s
    s.close()


def test_status_steps_and_roles(served):
    code, body = served.call("GET", "/v1/status")
    assert code == 200 and body["state"] == "STARTING" and body["total_steps"] == 10 and not body["paused"]
    for step in (1, 2, 3):
        served.status.record_step({"step": step, "reward/mean": step / 10}, policy_version=step)
    assert served.call("GET", "/v1/status")[1]["step"] == 3
    code, page = served.call("GET", "/v1/steps?since=1&limit=1")
    assert code == 200 and [r["step"] for r in page["steps"]] == [2] and page["next_since"] == 2
    assert served.call("GET", "/v1/steps?since=3")[1] == {"steps": [], "next_since": 3}
    code, roles = served.call("GET", "/v1/roles")
    assert code == 200 and roles[0]["role"] == "reward" and roles[0]["health"] == "UNREACHABLE"
    assert "connect" in roles[0]["error"] and roles[0]["workers"] is None


def test_errors_are_json_naming_what_is_wrong(served):
    code, body = served.call("GET", "/v1/steps?limit=0")
    assert code == 422 and "limit" in body["error"]
    code, body = served.call("GET", "/v1/steps?since=x")
    assert code == 422 and "since" in body["error"]
    assert served.call("GET", "/v1/nothing") == (404, {"error": "Not Found"})
    assert served.call("DELETE", "/v1/status")[0] == 405


def test_pause_resume_stop_and_what_an_ended_run_refuses(served):
    served.status.state = RunState.RUNNING
    served.status.stepping = True
    code, body = served.call("POST", "/v1/pause")
    assert code == 200 and body["state"] == "PAUSED" and body["paused"] and served.status.paused
    assert served.call("POST", "/v1/pause")[1]["state"] == "PAUSED"  # again: no change
    code, body = served.call("POST", "/v1/resume")
    assert code == 200 and body["state"] == "RUNNING" and not served.status.paused
    served.call("POST", "/v1/pause")
    code, body = served.call("POST", "/v1/stop")  # a paused run stops too: the loop wakes up
    assert code == 200 and body["state"] == "STOPPING" and not served.status.paused
    assert served.status.stop_requested
    code, body = served.call("POST", "/v1/resume")
    assert code == 409 and "stopping" in body["error"]
    served.status.state = RunState.FINISHED
    code, body = served.call("POST", "/v1/stop")
    assert code == 409 and "already ended (finished)" in body["error"]
    assert served.call("POST", "/v1/pause")[0] == 409


def test_schemathesis_finds_no_server_error_and_no_answer_outside_the_schema(served, tmp_path):
    served.status.record_step({"step": 1, "reward/mean": 0.5}, policy_version=1)
    proc = subprocess.run(
        [tool("schemathesis"), "run", f"{served.url}/openapi.json", "--checks", "all", "--max-examples", "25",
         "--seed", "1", "--request-timeout", "10", "--max-failures", "5"],
        capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
