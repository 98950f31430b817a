"""The HTTP control plane served by uvicorn on a loopback port, over a run status the test drives:
every endpoint's answers and errors, and schemathesis fuzzing it against its own OpenAPI schema."""

import asyncio
import json
import ssl
import subprocess
import threading
import urllib.error
import urllib.request

import pytest

from rolefleet.common.config import TlsSection
from rolefleet.coordinator.http import HTTP_ROLE, HttpControlPlane, make_app
from rolefleet.coordinator.state import RunState, RunStatus
from rolefleet.rpc.auth import AUTH_REFUSED
from tests.deploy.tools import tool

pytestmark = pytest.mark.timeout(180)
TOKEN = "http-test-token-0123456789"


class Served:
    """The control plane on its own event loop in a thread, as the coordinator serves it."""

    def __init__(self, addresses: dict[str, str], token: str | None = None, tls: TlsSection | None = None):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            self.status = RunStatus(run_name="fuzz", total_steps=10)
            return HttpControlPlane(make_app(self.status, addresses, token=token), "127.0.0.1", 0, tls)

        self.plane = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"{self.plane.scheme}://127.0.0.1:{self.plane.port}"

    def call(self, method: str, path: str, headers: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, method=method, headers=headers or {})
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


@pytest.fixture
def guarded():
    s = Served({"reward": "127.0.0.1:1"}, token=TOKEN)
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


def test_steps_include_the_evaluation_before_training_and_page_by_step(served):
    served.status.record_eval({"step": 0, "policy_version": 0, "eval/pass@1": 0.1})
    for step in (1, 2):
        served.status.record_step({"step": step, "reward/mean": step / 10}, policy_version=step)
    code, page = served.call("GET", "/v1/steps")
    assert code == 200 and [r["step"] for r in page["steps"]] == [0, 1, 2] and page["steps"][0]["eval/pass@1"] == 0.1
    page = served.call("GET", "/v1/steps?limit=1")[1]
    assert [r["step"] for r in page["steps"]] == [0] and page["next_since"] == 0
    page = served.call("GET", f"/v1/steps?since={page['next_since']}")[1]
    assert [r["step"] for r in page["steps"]] == [1, 2]  # following next_since moves on
    assert served.call("GET", "/v1/status")[1]["step"] == 2


def test_errors_are_json_naming_what_is_wrong(served):
    code, body = served.call("GET", "/v1/steps?limit=0")
    assert code == 422 and "limit" in body["error"]
    code, body = served.call("GET", "/v1/steps?since=x")
    assert code == 422 and "since" in body["error"]
    assert served.call("GET", "/v1/nothing") == (404, {"error": "Not Found"})
    assert served.call("DELETE", "/v1/status")[0] == 405


def test_a_kept_alive_connection_has_nagle_off(served):
    """uvicorn writes a response's head and body apart: with Nagle's algorithm on, the body waited
    for the client's delayed ACK, 40 ms a request on a kept-alive connection (each of an agent's
    turns at the actor's endpoint, which shares this server). asyncio turns it off for sockets it
    knows to be TCP, so the listening socket says it is."""
    import http.client
    import socket

    connection = http.client.HTTPConnection("127.0.0.1", served.plane.port, timeout=10)
    try:
        for _ in range(2):  # the second on the same connection
            connection.request("GET", "/healthz")
            assert json.load(connection.getresponse()) == {"status": "ok"}

        async def nodelay() -> list[int]:
            return [p.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                    for p in served.plane.server.server_state.connections]

        assert asyncio.run_coroutine_threadsafe(nodelay(), served.loop).result(10) == [1]
    finally:
        connection.close()


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


@pytest.mark.procs
def test_schemathesis_with_the_token_finds_no_server_error_no_answer_outside_the_schema_and_no_ignored_auth(
        guarded, tmp_path):
    """Fuzzed with authentication on: schemathesis's `ignored_auth` check also sends each request
    without the token and fails if that is answered."""
    guarded.status.record_step({"step": 1, "reward/mean": 0.5}, policy_version=1)
    proc = subprocess.run(
        [tool("schemathesis"), "run", f"{guarded.url}/openapi.json", "--checks", "all", "--max-examples", "25",
         "--seed", "1", "--request-timeout", "10", "--max-failures", "5", "-H", f"Authorization: Bearer {TOKEN}"],
        capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_token_guards_every_route_but_healthz_and_refusals_are_counted(guarded):
    def refusals(reason):
        return AUTH_REFUSED.labels(HTTP_ROLE, reason)._value.get()

    missing, wrong = refusals("missing"), refusals("wrong")
    assert guarded.call("GET", "/healthz") == (200, {"status": "ok"})  # probes carry no secret
    code, body = guarded.call("GET", "/v1/status")
    assert code == 401 and body["error"].startswith("missing token") and TOKEN not in body["error"]
    code, body = guarded.call("POST", "/v1/stop", {"Authorization": "Bearer " + "x" * 30})
    assert code == 401 and body["error"].startswith("wrong token")
    assert not guarded.status.stop_requested  # a refused request changes nothing
    assert guarded.call("GET", "/v1/status", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    assert refusals("missing") == missing + 1 and refusals("wrong") == wrong + 1
    schema = guarded.call("GET", "/openapi.json")[1]
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_mutual_tls_control_plane_answers_the_cli_with_the_runs_certificates(tmp_path, monkeypatch, capsys):
    from rolefleet.certs import make_certs
    from rolefleet.cli import main

    make_certs(tmp_path / "certs")
    make_certs(tmp_path / "other")
    c = tmp_path / "certs"
    tls = TlsSection(cert_file=f"{c}/{{role}}.pem", key_file=f"{c}/{{role}}-key.pem", ca_file=f"{c}/ca.pem",
                     mutual=True)
    s = Served({}, token=TOKEN, tls=tls)
    try:
        assert s.url.startswith("https://")
        monkeypatch.setenv("ROLEFLEET_TOKEN", TOKEN)
        assert main(["status", "--http", s.url, "--certs", str(c)]) == 0
        assert "run fuzz: STARTING, step 0/10" in capsys.readouterr().out
        assert main(["status", "--http", s.url, "--certs", str(tmp_path / "other")]) == 1  # another CA
        assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
        # No client certificate: refused in the handshake (under TLS 1.3 the client learns it as the
        # server closing the connection).
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(s.url + "/healthz", timeout=10,
                                   context=ssl.create_default_context(cafile=f"{c}/ca.pem"))
    finally:
        s.close()
