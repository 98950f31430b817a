"""TLS and mutual TLS of a role server (rpc/tls.py, rpc/guard.py) with certificates from
`rolefleet certs`: calls over TLS succeed; plaintext, a missing client certificate and another CA's
are refused and counted; renewed files are picked up without a restart; unusable files are refused
at start naming the key; the per-client call limit and the decode guard answer clear statuses."""

import asyncio
import logging
import shutil
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rolefleet.certs import make_certs
from rolefleet.common.config import ConfigError, Endpoint, SecuritySection, TlsSection, parse_config
from rolefleet.rpc import tls as tls_module
from rolefleet.rpc.guard import CALLS_REFUSED
from rolefleet.rpc.roles import open_channel, use_security
from rolefleet.rpc.security import Security
from rolefleet.rpc.server import start_server
from rolefleet.rpc.tls import TlsError
from tests.helpers import CONNECT_ONCE

TOKEN = "tls-test-token-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    make_certs(root / "run")
    make_certs(root / "other")  # another CA: its certificates must not pass
    return root


def security(directory, role: str, mutual: bool, token: str | None = None) -> Security:
    section = SecuritySection(tls=TlsSection(cert_file=f"{directory}/{{role}}.pem", key_file=f"{directory}/{{role}}-key.pem",
                                             ca_file=f"{directory}/ca.pem", mutual=mutual))
    return Security(token, Security.of(section, role).tls)


async def echo(request: bytes, context) -> bytes:
    return request


SLOW_IN_FLIGHT = [0]  # `slow` calls the server is running now


async def slow(request: bytes, context) -> bytes:
    SLOW_IN_FLIGHT[0] += 1
    try:
        await asyncio.sleep(1.0)
    finally:
        SLOW_IN_FLIGHT[0] -= 1
    return request


def add_echo(server: grpc.aio.Server) -> list[str]:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo), "Slow": grpc.unary_unary_rpc_method_handler(slow)}),))
    return ["test.Echo"]


def refused(role: str) -> float:
    """rolefleet_tls_refused_total{role} as a scrape reads it."""
    samples = [s for metric in tls_module._RefusedCollector().collect() for s in metric.samples]
    return next((s.value for s in samples if s.labels["role"] == role), 0.0)


async def health(channel) -> str:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def refused_code(channel, method: str = "/test.Echo/Echo") -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary(method)(b"x", timeout=5)
    return err.value.code()


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_serves_the_runs_clients_and_refuses_the_others(certs, monkeypatch, mutual):
    monkeypatch.setattr(tls_module, "SETTLE_S", 0.3)
    role = f"tls{int(mutual)}"

    async def scenario():
        handle = await start_server(role, Endpoint(port=0, metrics_port=0), add_echo,
                                    security(certs / "run", "actor", mutual, TOKEN))
        address = f"127.0.0.1:{handle.grpc_port}"
        try:
            use_security(security(certs / "run", "client", False, TOKEN))
            async with open_channel(address) as channel:  # the run's own clients: TLS, the token
                assert await channel.unary_unary("/test.Echo/Echo")(b"hi", timeout=5) == b"hi"
                assert await health(channel) == "SERVING"
            before = refused(role)
            async with grpc.aio.insecure_channel(address, options=CONNECT_ONCE) as plain:
                assert await refused_code(plain) == grpc.StatusCode.UNAVAILABLE
            attempts = 1
            ca = (certs / "run" / "ca.pem").read_bytes()
            other = certs / "other"
            foreign = grpc.ssl_channel_credentials(ca, (other / "client-key.pem").read_bytes(),
                                                   (other / "client.pem").read_bytes())
            bare = grpc.ssl_channel_credentials(ca)
            for credentials in (foreign, bare):
                async with grpc.aio.secure_channel(address, credentials, options=CONNECT_ONCE) as channel:
                    if mutual:  # refused in the handshake
                        assert await refused_code(channel) == grpc.StatusCode.UNAVAILABLE
                        attempts += 1
                    else:  # TLS without client certificates: the token still guards the call
                        assert await refused_code(channel) == grpc.StatusCode.UNAUTHENTICATED
            # A server certificate of another CA is refused by the run's clients too.
            async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(
                    (other / "ca.pem").read_bytes()), options=CONNECT_ONCE) as channel:
                assert await refused_code(channel) == grpc.StatusCode.UNAVAILABLE
            attempts += 1
            await asyncio.sleep(0.5)
            # Each refused handshake is counted once; the accepted connections are not.
            assert refused(role) - before == attempts
        finally:
            await handle.stop()

    asyncio.run(scenario())


def test_renewed_certificate_files_are_served_without_a_restart(certs, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(certs / "run", live)

    async def scenario():
        handle = await start_server("renew", Endpoint(port=0, metrics_port=0), add_echo,
                                    security(live, "actor", mutual=True))
        address = f"127.0.0.1:{handle.grpc_port}"
        try:
            use_security(security(live, "client", False))
            async with open_channel(address) as channel:
                assert await health(channel) == "SERVING"
            old_ca = (live / "ca.pem").read_bytes()
            make_certs(live, force=True)  # a new CA and new certificates in place
            use_security(security(live, "client", False))
            async with open_channel(address) as channel:  # a new connection: the renewed files
                assert await health(channel) == "SERVING"
            stale = grpc.ssl_channel_credentials(old_ca, (certs / "run" / "client-key.pem").read_bytes(),
                                                 (certs / "run" / "client.pem").read_bytes())
            async with grpc.aio.secure_channel(address, stale) as channel:
                assert await refused_code(channel) == grpc.StatusCode.UNAVAILABLE
        finally:
            await handle.stop()

    asyncio.run(scenario())


def test_unusable_tls_files_are_refused_at_start_naming_the_key(certs, tmp_path):
    run = certs / "run"
    section = SecuritySection(tls=TlsSection(cert_file=str(run / "actor.pem"), key_file=str(run / "reward-key.pem")))
    with pytest.raises(TlsError, match=r"security.tls.key_file: .*reward-key.pem is not the key of .*actor.pem"):
        Security.of(section, "actor")
    section = SecuritySection(tls=TlsSection(cert_file=str(run / "ca-key.pem"), key_file=str(run / "actor-key.pem")))
    with pytest.raises(TlsError, match="security.tls.cert_file: .*holds no PEM certificate"):
        Security.of(section, "actor")
    section = SecuritySection(tls=TlsSection(cert_file="{role}.pem", key_file=str(tmp_path / "absent.pem")))
    with pytest.raises(TlsError, match="security.tls.cert_file: cannot read actor.pem"):
        Security.of(section, "actor")
    for overrides, key in ((["security.tls.cert_file=a.pem"], "key_file"),
                           (["security.tls.mutual=true"], "mutual"),
                           (["security.tls.ca_file=ca.pem"], "ca_file")):
        with pytest.raises(ConfigError, match=f"security.tls.{key}"):
            parse_config({}, overrides)


def test_binding_every_interface_without_tls_warns(caplog):
    async def scenario():
        with caplog.at_level(logging.WARNING, logger="rolefleet.rpc.server"):
            handle = await start_server("exposed", Endpoint(host="0.0.0.0", port=0, metrics_port=0), add_echo)
            await handle.stop()

    asyncio.run(scenario())
    assert "listens on all interfaces (0.0.0.0) without TLS or a token" in caplog.text


def test_a_client_over_its_call_limit_is_refused_and_health_still_answers():
    """One connection never opens more streams than the limit (HTTP/2 makes the client queue them);
    a client host spreading calls over several connections is refused beyond it."""
    own_connection = [("grpc.use_local_subchannel_pool", 1)]

    async def scenario():
        handle = await start_server("limited", Endpoint(port=0, metrics_port=0), add_echo,
                                    Security(max_calls_per_client=2))
        address = f"127.0.0.1:{handle.grpc_port}"
        before = CALLS_REFUSED.labels("limited", "too_many_calls")._value.get()
        channels = [grpc.aio.insecure_channel(address, options=own_connection) for _ in range(3)]
        try:
            slow_calls = [asyncio.ensure_future(c.unary_unary("/test.Echo/Slow")(b"s", timeout=5))
                          for c in channels[:2]]
            deadline = time.monotonic() + 5
            while SLOW_IN_FLIGHT[0] < 2:  # both in the server (the same process, the same loop)
                assert time.monotonic() < deadline, "the two slow calls did not reach the server"
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channels[2].unary_unary("/test.Echo/Echo")(b"x", timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "127.0.0.1 has 2 calls in flight" in err.value.details()
            assert "security.max_calls_per_client" in err.value.details()
            assert await health(channels[2]) == "SERVING"  # probes are not limited
            assert await asyncio.gather(*slow_calls) == [b"s", b"s"]
            assert await channels[2].unary_unary("/test.Echo/Echo")(b"x", timeout=5) == b"x"  # freed again
            # Over one connection the third call waits for a stream instead of failing.
            slow = [channels[0].unary_unary("/test.Echo/Slow")(b"q", timeout=5) for _ in range(3)]
            assert await asyncio.gather(*slow) == [b"q"] * 3
        finally:
            for channel in channels:
                await channel.close()
            await handle.stop()
        assert CALLS_REFUSED.labels("limited", "too_many_calls")._value.get() == before + 1

    asyncio.run(scenario())


def test_a_request_that_is_not_its_message_is_invalid_argument():
    async def scenario():
        handle = await start_server("decode", Endpoint(port=0, metrics_port=0), lambda server: [])
        try:
            async with open_channel(f"127.0.0.1:{handle.grpc_port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff\xff\xff", timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "request: not a valid message" in err.value.details()
        finally:
            await handle.stop()

    asyncio.run(scenario())


def test_kept_channels_make_one_handshake_a_server_for_repeated_status_calls(certs):
    """The coordinator's status views (KeptChannels): health and status polled again and again cost
    the server one TLS handshake; a channel of each call's own costs one a call."""
    from rolefleet.rpc.roles import KeptChannels, check_health

    role = "kept"

    def handshakes() -> float:
        return tls_module.TLS_HANDSHAKES.labels(role)._value.get()

    async def scenario():
        handle = await start_server(role, Endpoint(port=0, metrics_port=0), add_echo,
                                    security(certs / "run", "actor", True))
        address = f"127.0.0.1:{handle.grpc_port}"
        try:
            use_security(security(certs / "run", "client", False))
            kept, before = KeptChannels(), handshakes()
            for _ in range(3):
                assert await check_health(address, 5, kept) == "SERVING"
            assert handshakes() - before == 1
            await kept.close()
            assert await check_health(address, 5, kept) == "SERVING"  # reopened after a close
            assert handshakes() - before == 2
            await kept.close()
            before = handshakes()
            for _ in range(3):
                assert await check_health(address, 5) == "SERVING"
            assert handshakes() - before == 3
        finally:
            await handle.stop()

    asyncio.run(scenario())
