"""Token authentication of role servers: no token, a wrong token and a valid one, on unary and
streaming methods; health stays open for probes; refusals are counted; tokens load with clear errors."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rolefleet.common.config import SecuritySection
from rolefleet.rpc.auth import AUTH_REFUSED, TokenError, client_interceptors, load_token, write_run_token
from rolefleet.rpc.guard import GuardInterceptor
from rolefleet.rpc.security import Security, Unauthenticated, is_loopback, refuse_if_open

TOKEN = "s3cret-token-of-the-run-0123456789"


def refused(reason: str) -> float:
    return AUTH_REFUSED.labels("test", reason)._value.get()


async def echo(request: bytes, context) -> bytes:
    return request


async def echo_stream(request: bytes, context):
    for _ in range(2):
        yield request


def test_calls_need_the_runs_token_except_health_checks():
    async def scenario():
        server = grpc.aio.server(interceptors=[GuardInterceptor("test", TOKEN)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Stream": grpc.unary_stream_rpc_method_handler(echo_stream)}),))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        missing, wrong = refused("missing"), refused("wrong")
        try:
            async with grpc.aio.insecure_channel(address) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plain.unary_unary("/test.Echo/Echo")(b"x", timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "missing token" in err.value.details() and TOKEN not in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in plain.unary_stream("/test.Echo/Stream")(b"x", timeout=5)]
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                reply = await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
            async with grpc.aio.insecure_channel(address, interceptors=client_interceptors("x" * 20)) as bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await bad.unary_unary("/test.Echo/Echo")(b"x", timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "wrong token" in err.value.details()
            async with grpc.aio.insecure_channel(address, interceptors=client_interceptors(TOKEN)) as good:
                assert await good.unary_unary("/test.Echo/Echo")(b"x", timeout=5) == b"x"
                assert [m async for m in good.unary_stream("/test.Echo/Stream")(b"y", timeout=5)] == [b"y", b"y"]
        finally:
            await server.stop(None)
        assert refused("missing") == missing + 2 and refused("wrong") == wrong + 1

    asyncio.run(scenario())


def test_tokens_load_from_a_file_or_the_environment_with_clear_errors(tmp_path, monkeypatch):
    assert load_token(None, "ROLEFLEET_TEST_TOKEN") is None  # none configured: authentication off
    monkeypatch.setenv("ROLEFLEET_TEST_TOKEN", TOKEN)
    assert load_token(None, "ROLEFLEET_TEST_TOKEN") == TOKEN
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert load_token(str(path), "ROLEFLEET_TEST_TOKEN") == TOKEN  # the file wins
    path.write_text("short\n")
    with pytest.raises(TokenError, match=r"security.token_file .*shorter than 16 characters") as err:
        load_token(str(path), None)
    assert "short" not in str(err.value).replace("shorter", "")  # never the value
    path.write_text("")
    with pytest.raises(TokenError, match="shorter than 16"):
        load_token(str(path), None)
    with pytest.raises(TokenError, match="security.token_file: cannot read"):
        load_token(str(tmp_path / "absent"), None)
    monkeypatch.setenv("ROLEFLEET_TEST_TOKEN", "has a space in it, see")
    with pytest.raises(TokenError, match="ROLEFLEET_TEST_TOKEN .*whitespace"):
        load_token(None, "ROLEFLEET_TEST_TOKEN")


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.1.1", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
                                            ("10.0.0.5", False), ("actor", False)])
def test_which_hosts_are_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_a_server_beyond_loopback_needs_a_token_or_mutual_tls():
    binds = {"actor.host": "127.0.0.1", "coordinator.http_host": "0.0.0.0"}
    with pytest.raises(Unauthenticated, match=r"actor: coordinator\.http_host=0\.0\.0\.0 is reachable"):
        refuse_if_open("actor", binds, Security(), SecuritySection())
    tls_files = object()  # a loaded certificate: what matters is whether clients must present one
    with pytest.raises(Unauthenticated):  # TLS without mutual admits any client
        refuse_if_open("actor", binds, Security(tls=tls_files), SecuritySection())
    mutual = SecuritySection(tls={"cert_file": "c.pem", "key_file": "k.pem", "ca_file": "ca.pem", "mutual": True})
    refuse_if_open("actor", binds, Security(tls=tls_files), mutual)
    refuse_if_open("actor", binds, Security(token=TOKEN), SecuritySection())
    refuse_if_open("actor", binds, Security(), SecuritySection(allow_unauthenticated=True))
    refuse_if_open("actor", {"actor.host": "127.0.0.1"}, Security(), SecuritySection())


def test_a_run_token_is_random_owner_only_and_loads(tmp_path):
    first = write_run_token(tmp_path / "run" / "token")
    assert first.is_absolute() and first.stat().st_mode & 0o777 == 0o600
    token = load_token(str(first), None)
    assert len(token) >= 32
    (tmp_path / "run" / "token").chmod(0o644)  # a file left by an older run: replaced, owner-only again
    again = write_run_token(tmp_path / "run" / "token")
    assert load_token(str(again), None) != token and again.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["token"]
