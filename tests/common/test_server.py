"""The server bootstrap refuses busy ports (no silent port sharing) and says so plainly."""

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from rolefleet.common.config import Endpoint, RewardSection
from rolefleet.common.role_types import INSTANCE_ID
from rolefleet.reward import server as reward_server
from rolefleet.reward.core import RewardCore
from rolefleet.rpc.roles import KeptChannels, check_health, fetch_status
from rolefleet.rpc.server import StartupError, check_ports_free, start_server


def add_reward(server):
    return reward_server.add_to_server(RewardCore(RewardSection()), server)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_second_server_on_a_busy_grpc_port_is_refused_and_the_first_keeps_answering():
    async def scenario():
        first = await start_server("reward", Endpoint(port=0), add_reward)
        try:
            metrics_port = free_port()
            busy = Endpoint(port=first.grpc_port, metrics_port=metrics_port)
            with pytest.raises(StartupError, match=f"reward: cannot listen for gRPC on 127.0.0.1:{first.grpc_port}"):
                check_ports_free("reward", busy)  # the fast check before models load
            with pytest.raises(StartupError, match="pick another reward.port"):
                await start_server("reward", busy, add_reward)  # the real bind: no SO_REUSEPORT sharing
            status = await fetch_status("reward", f"127.0.0.1:{first.grpc_port}", 10)
            assert status.instance_id == INSTANCE_ID
            # The refused server left nothing bound: its metrics port is free again.
            second = await start_server("reward", Endpoint(port=0, metrics_port=metrics_port), add_reward)
            await second.stop()
        finally:
            await first.stop()

    asyncio.run(scenario())


def test_a_busy_metrics_port_is_a_clear_error_and_frees_the_grpc_port():
    async def scenario():
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            taken = holder.getsockname()[1]
            grpc_port = free_port()
            endpoint = Endpoint(port=grpc_port, metrics_port=taken)
            with pytest.raises(StartupError, match=f"cannot listen for metrics on 127.0.0.1:{taken}.*metrics_port"):
                check_ports_free("reward", endpoint)
            with pytest.raises(StartupError, match="metrics_port"):
                await start_server("reward", Endpoint(port=grpc_port, metrics_port=taken), add_reward)
        handle = await start_server("reward", Endpoint(port=grpc_port), add_reward)  # nothing was left bound
        await handle.stop()

    asyncio.run(scenario())


@pytest.mark.procs
def test_serve_on_a_busy_port_exits_with_a_message_not_a_traceback(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = tmp_path / "c.yaml"
        config.write_text(f"model: {{model_name_or_path: some/model}}\nreward: {{port: {port}}}\n")
        proc = subprocess.run([sys.executable, "-m", "rolefleet.cli", "serve", "reward", "--config", str(config)],
                              capture_output=True, text=True, timeout=60, env={"CUDA_VISIBLE_DEVICES": "",
                                                                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stderr
    assert f"reward: cannot listen for gRPC on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_role_that_refuses_updates_reports_not_serving():
    """compose and Kubernetes restart on health: a broken role must not stay SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rolefleet.rpc.roles import open_channel

    async def scenario():
        handle = await start_server("reward", Endpoint(port=0), add_reward)
        broken = ""
        watch = asyncio.ensure_future(handle.report_broken(lambda: broken, period_s=0.05))
        try:
            async with open_channel(f"127.0.0.1:{handle.grpc_port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def health(service=""):
                    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

                assert await health() == health_pb2.HealthCheckResponse.SERVING
                broken = "the update of step 3 failed after 1 of 2 optimizer steps"
                await asyncio.wait_for(watch, 5)
                assert await health() == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await health("rolefleet.v1.RewardService") == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            watch.cancel()
            await handle.stop()

    asyncio.run(scenario())


def test_clients_retry_a_call_answered_unavailable():
    """A server that is restarting answers UNAVAILABLE: the project's channels retry with backoff."""
    import grpc

    from rolefleet.rpc.roles import open_channel

    calls = []

    async def echo(request: bytes, context) -> bytes:
        calls.append(request)
        if len(calls) < 3:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return request

    async def scenario():
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler("test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with open_channel(f"127.0.0.1:{port}") as channel:
                assert await channel.unary_unary("/test.Echo/Echo")(b"x", timeout=10) == b"x"
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    assert len(calls) == 3


def test_a_kept_channel_answers_within_seconds_of_its_server_coming_back():
    """A kept channel (the coordinator's status views) to a server that is down tries again at
    least every ~2 s (gRPC's own backoff grows 1, 1.6, 2.6, 4.1, 6.6 s ... to 2 minutes), so the
    server is reached within seconds of its start however long it was down."""
    port = free_port()
    address = f"127.0.0.1:{port}"

    async def scenario():
        attempts = []

        async def hang_up(reader, writer):  # a port that takes connections and closes them: no server
            attempts.append(time.monotonic())
            writer.close()

        kept = KeptChannels()
        try:
            listener = await asyncio.start_server(hang_up, "127.0.0.1", port)
            async with listener:
                assert await check_health(address, 0.5, kept) == "UNREACHABLE"
                await asyncio.sleep(12)  # uncapped, the 4th wait (~4.1 s) falls within
            waits = [b - a for a, b in zip(attempts, attempts[1:])]
            assert len(attempts) >= 5 and max(waits) < 3.2, waits
            handle = await start_server("back", Endpoint(port=port, metrics_port=0), add_reward)
            try:
                started = time.monotonic()
                while await check_health(address, 0.5, kept) != "SERVING":
                    assert time.monotonic() - started < 10, "the kept channel did not reconnect"
                    await asyncio.sleep(0.2)
            finally:
                await handle.stop()
        finally:
            await kept.close()

    asyncio.run(scenario())
