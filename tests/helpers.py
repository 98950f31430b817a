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


async def expect_code(call, code: grpc.StatusCode, *texts: str) -> str:
    """Await a raw stub call (or a stream's read); require `code` with every one of `texts` in the
    message."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        assert e.code() == code, (e.code(), e.details())
        for text in texts:
            assert text in e.details(), e.details()
        return e.details()
    raise AssertionError(f"expected {code.name} naming {texts}")


async def expect_invalid(call, field: str) -> str:
    """Await a raw stub call; require INVALID_ARGUMENT whose message names `field`."""
    return await expect_code(call, grpc.StatusCode.INVALID_ARGUMENT, field)
