"""What every call to a role server passes before its handler runs (issue 14; docs/security.md).

In order: the connection is noted (under TLS, a connection's first call proves its handshake; see
rpc/tls.py); the run's token is checked (UNAUTHENTICATED); a request that does not decode as its
message is refused (INVALID_ARGUMENT, where gRPC itself would answer INTERNAL); a client host with
`security.max_calls_per_client` calls already in flight is refused (RESOURCE_EXHAUSTED). The standard
health service is exempt from the token and the limit: probes carry no secret and must answer while
a role is busy.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Callable
from typing import Any, Optional

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from rolefleet.rpc.auth import AUTH_REFUSED, token_matches
from rolefleet.rpc.tls import ServerTls

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
CALLS_REFUSED = Counter("rolefleet_calls_refused", "Calls refused before their handler ran: a request that "
                        "does not decode, or a client over security.max_calls_per_client", ["role", "reason"])


class _Undecodable:
    """Stands for a request whose bytes are not its message (the handler is never called with it)."""

    def __init__(self, error: str):
        self.error = error


def _safe(deserializer: Optional[Callable[[bytes], Any]]) -> Optional[Callable[[bytes], Any]]:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError) as exc:
            return _Undecodable(str(exc) or type(exc).__name__)

    return decode


def client_host(peer: str) -> str:
    """The client's host from gRPC's peer string (`ipv4:10.0.0.5:51234`, `ipv6:[::1]:4000`)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer


class GuardInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, role: str, token: Optional[str] = None, max_calls_per_client: int = 128,
                 tls: Optional[ServerTls] = None):
        self.role, self.token, self.max_calls, self.tls = role, token, max_calls_per_client, tls
        self.in_flight: collections.Counter[str] = collections.Counter()  # by client host; one event loop
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}  # wrapped once per method

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if details.method in self._handlers:
            return self._handlers[details.method]
        handler = await continuation(details)
        wrapped = self._guarded(handler, details.method)
        if handler is not None:  # known methods only: a caller inventing names must not grow the cache
            self._handlers[details.method] = wrapped
        return wrapped

    def _guarded(self, handler: Optional[grpc.RpcMethodHandler], method: str) -> Optional[grpc.RpcMethodHandler]:
        guarded = not method.startswith(OPEN_SERVICES)
        if handler is None:
            if not (guarded and self.token):
                return None  # gRPC answers UNIMPLEMENTED
            # Unknown methods are refused like known ones: no probing of what exists without the token.
            handler = grpc.unary_unary_rpc_method_handler(_unimplemented)
        return _wrapped(handler, lambda request, context: self._admitted(request, context, guarded))

    @contextlib.asynccontextmanager
    async def _admitted(self, request: Any, context: grpc.aio.ServicerContext, guarded: bool):
        peer = context.peer()
        if self.tls is not None:
            self.tls.connected(peer)
        if guarded and self.token:
            reason = token_matches(context.invocation_metadata(), self.token)
            if reason is not None:
                AUTH_REFUSED.labels(self.role, reason).inc()
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self.role}: {reason} token: calls need "
                                    "`authorization: Bearer <the run's token>` (security.token_file / "
                                    "security.token_env)")
        if isinstance(request, _Undecodable):
            CALLS_REFUSED.labels(self.role, "undecodable").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid message of this method ({request.error})")
        host = client_host(peer)
        if guarded and self.in_flight[host] >= self.max_calls:
            CALLS_REFUSED.labels(self.role, "too_many_calls").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.role}: {host} has {self.in_flight[host]} calls in flight, the most one "
                                "client may (security.max_calls_per_client)")
        self.in_flight[host] += 1
        try:
            yield
        finally:
            self.in_flight[host] -= 1
            if not self.in_flight[host]:
                del self.in_flight[host]


async def _unimplemented(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no such method")


def _wrapped(handler: grpc.RpcMethodHandler, admitted: Callable) -> grpc.RpcMethodHandler:
    """`handler` with its behavior run inside `admitted(request, context)` and undecodable requests
    passed on as _Undecodable (request streams keep gRPC's own decoding)."""
    if handler.request_streaming and handler.response_streaming:
        behavior, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler

    if inspect.isasyncgenfunction(behavior):
        async def run(request, context):
            async with admitted(request, context):
                async for response in behavior(request, context):
                    yield response
    else:  # a coroutine (a streaming one may write through context.write)
        async def run(request, context):
            async with admitted(request, context):
                return await behavior(request, context)

    deserializer = handler.request_deserializer if handler.request_streaming else _safe(handler.request_deserializer)
    return make(run, request_deserializer=deserializer, response_serializer=handler.response_serializer)
