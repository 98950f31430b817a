"""Test helpers: in-process gRPC servers on ephemeral loopback ports, and status assertions."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from rolefleet.common.config import Endpoint
from rolefleet.common.server import start_server


@contextlib.asynccontextmanager
async def serving(role: str, add_servicers: Callable[[grpc.aio.Server], list[str]]) -> AsyncIterator[str]:
    """Run a role's servicers on 127.0.0.1:<ephemeral>; yields the address to dial."""
    handle = await start_server(role, Endpoint(port=0, metrics_port=0), add_servicers)
    try:
        yield f"127.0.0.1:{handle.grpc_port}"
    finally:
        await handle.stop()


async def expect_invalid(call, field: str) -> str:
    """Await a raw stub call; require INVALID_ARGUMENT whose message names `field`."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert field in e.details(), e.details()
        return e.details()
    raise AssertionError(f"expected INVALID_ARGUMENT naming {field}")
