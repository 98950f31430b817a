"""What every role client shares: channels with the process's security, and the gRPC call wrapper."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rolefleet.common.errors import Unavailable, error_from_rpc
from rolefleet.common.pb import actor_pb2_grpc, common_pb2, critic_pb2_grpc, reward_pb2_grpc, teacher_pb2_grpc
from rolefleet.common.role_types import CheckpointInfo, RoleStatus
from rolefleet.rpc.auth import client_interceptors
from rolefleet.rpc.channels import client_options
from rolefleet.rpc.security import OPEN, Security

T = TypeVar("T")


_security = OPEN  # what every call of this process presents: the run's token, its certificate


def use_security(security: Security) -> None:
    """Set once at start (serve.py, up.py, the CLI): every channel opened afterwards presents it."""
    global _security
    _security = security


def open_channel(address: str, extra_options: tuple[tuple[str, int], ...] = ()) -> grpc.aio.Channel:
    options, interceptors = [*client_options(_security), *extra_options], client_interceptors(_security.token)
    if _security.tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, _security.tls.channel_credentials(), options=options,
                                   interceptors=interceptors)


# Where a call finds its channel: `open_channel` (a channel of its own, closed after the call) or a
# `KeptChannels` (one channel an address, kept for the process's next calls).
ChannelSource = Callable[[str], contextlib.AbstractAsyncContextManager[grpc.aio.Channel]]


class KeptChannels:
    """One channel an address, opened at its first call and kept until `close`, for calls a process
    repeats to the same servers (the coordinator's status views, polled by dashboards and `rolefleet
    status`): one connection, and under TLS one handshake, a server instead of one a call. A call
    given up before its connection was made would otherwise leave a handshake no call follows, which
    the server counts as refused (rpc/tls.py). The channels belong to the event loop that opened them."""

    # A server that was down while the views were polled answers them again within 2 s of coming
    # back: gRPC's reconnect backoff would otherwise grow to 2 minutes between attempts.
    OPTIONS = (("grpc.max_reconnect_backoff_ms", 2000),)

    def __init__(self):
        self._open: dict[str, grpc.aio.Channel] = {}

    @contextlib.asynccontextmanager
    async def __call__(self, address: str) -> AsyncIterator[grpc.aio.Channel]:
        if address not in self._open:
            self._open[address] = open_channel(address, self.OPTIONS)
        yield self._open[address]  # gRPC reconnects it on its own when its server restarts

    async def close(self) -> None:
        channels, self._open = list(self._open.values()), {}
        for channel in channels:
            await channel.close()


class GrpcRoleClient:
    """Channel, stub and the calls every role answers; subclasses set `stub_class` and add theirs."""

    stub_class: type

    def __init__(self, address: str, timeout_s: float):
        self.channel = open_channel(address)
        self.stub = self.stub_class(self.channel)
        self.timeout_s = timeout_s

    async def status(self, include_digest: bool = False) -> RoleStatus:
        request = common_pb2.GetStatusRequest(include_weights_digest=include_digest)
        msg = await call(self.stub.GetStatus(request, timeout=self.timeout_s))
        return RoleStatus.from_proto(msg)

    async def close(self) -> None:
        await self.channel.close()


class GrpcTrainerClient(GrpcRoleClient):
    """The calls of the roles that train (actor, critic): checkpoints."""

    async def save_checkpoint(self, step: int, path: str, background: bool = False) -> CheckpointInfo:
        request = common_pb2.SaveCheckpointRequest(step=step, path=path, background=background)
        return CheckpointInfo.from_proto(await call(self.stub.SaveCheckpoint(request, timeout=self.timeout_s)))

    async def load_checkpoint(self, path: str) -> CheckpointInfo:
        request = common_pb2.LoadCheckpointRequest(path=path)
        return CheckpointInfo.from_proto(await call(self.stub.LoadCheckpoint(request, timeout=self.timeout_s)))


class InProcessTrainerClient:
    """A trainer role's core called in this process (tests, benchmarks), on a worker thread as the
    server would: its status and checkpoint calls; each role adds its own."""

    def __init__(self, core):
        self.core = core

    async def status(self, include_digest: bool = False) -> RoleStatus:
        return await asyncio.to_thread(self.core.status, include_digest)

    async def save_checkpoint(self, step: int, path: str, background: bool = False) -> CheckpointInfo:
        return await asyncio.to_thread(self.core.save_checkpoint, step, path, background)

    async def load_checkpoint(self, path: str) -> CheckpointInfo:
        return await asyncio.to_thread(self.core.load_checkpoint, path)

    async def close(self) -> None:
        pass


def _status_stubs() -> dict[str, type]:
    return {"actor": actor_pb2_grpc.ActorServiceStub, "critic": critic_pb2_grpc.CriticServiceStub,
            "reward": reward_pb2_grpc.RewardServiceStub, "teacher": teacher_pb2_grpc.TeacherServiceStub}


async def fetch_status(role: str, address: str, timeout_s: float, include_digest: bool = False,
                       channels: ChannelSource = open_channel) -> RoleStatus:
    """GetStatus of the `role` server at `address`, with nothing but the stubs (no role client)."""
    async with channels(address) as channel:
        stub = _status_stubs()[role](channel)
        request = common_pb2.GetStatusRequest(include_weights_digest=include_digest)
        return RoleStatus.from_proto(await call(stub.GetStatus(request, timeout=timeout_s)))


async def call(awaitable: Awaitable[T]) -> T:
    """Await a unary call, raising the domain error (InvalidArgument, ...) instead of AioRpcError."""
    try:
        return await awaitable
    except grpc.aio.AioRpcError as e:
        raise error_from_rpc(e) from None


async def check_health(address: str, timeout_s: float, channels: ChannelSource = open_channel) -> str:
    """What the standard health service at `address` answers (SERVING, NOT_SERVING, ...), or
    UNREACHABLE when nothing answers within `timeout_s`."""
    async with channels(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_healthy(role: str, address: str, timeout_s: float,
                       give_up: Callable[[], bool] = lambda: False, channels: ChannelSource = open_channel) -> None:
    """Poll the standard health service until `address` answers SERVING; raise Unavailable on
    timeout or as soon as `give_up()` is true."""
    deadline = time.monotonic() + timeout_s
    async with channels(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass  # not up yet
            if give_up():
                raise Unavailable(f"gave up waiting for {role} at {address}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{role} at {address} was not SERVING within {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
