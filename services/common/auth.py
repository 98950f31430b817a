"""Token authentication of the gRPC role servers (issue 14; DESIGN "Security").

Every role of a run shares one secret token. A server with a token refuses any call whose
`authorization` metadata is not `Bearer <token>` with UNAUTHENTICATED, except the standard health
service: compose health checks and Kubernetes probes carry no secret. Tokens are compared in
constant time, never logged, and each refusal is counted (`rolefleet_auth_refused_total`, by role
and reason). A client attaches the token to every call through the interceptors below.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from pathlib import Path

import grpc
from prometheus_client import Counter

AUTH_REFUSED = Counter("rolefleet_auth_refused", "Calls refused for want of the run's token", ["role", "reason"])
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # probes carry no secret
HEADER = "authorization"
MIN_TOKEN_CHARS = 16


class TokenError(ValueError):
    """A configured token that cannot be used; the message names where it came from, never its value."""


def load_token(token_file: str | None, token_env: str | None) -> str | None:
    """The run's token from `token_file` (its first line) or else the environment variable named
    `token_env`; None when neither is set (authentication off)."""
    if token_file:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as exc:
            raise TokenError(f"security.token_file: cannot read {token_file} ({exc.strerror or exc})") from None
        token, source = (lines[0].strip() if lines else ""), f"security.token_file ({token_file})"
    elif token_env and os.environ.get(token_env):
        token, source = os.environ[token_env].strip(), f"the environment variable {token_env} (security.token_env)"
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"{source}: the token is shorter than {MIN_TOKEN_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise TokenError(f"{source}: the token has whitespace or control characters")
    return token


def token_matches(metadata, token: str) -> str | None:
    """None when `metadata` carries the token; else why not ("missing" or "wrong")."""
    presented = dict(metadata or ()).get(HEADER)
    if presented is None:
        return "missing"
    expected = f"Bearer {token}".encode()
    given = presented.encode() if isinstance(presented, str) else bytes(presented)
    return None if hmac.compare_digest(given, expected) else "wrong"


class TokenServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, role: str, token: str):
        self.role, self.token = role, token

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if details.method.startswith(OPEN_SERVICES):
            return await continuation(details)
        reason = token_matches(details.invocation_metadata, self.token)
        if reason is None:
            return await continuation(details)
        AUTH_REFUSED.labels(self.role, reason).inc()
        handler = await continuation(details)
        return _refusing(handler, f"{self.role}: {reason} token: calls need `authorization: Bearer <the run's "
                                  "token>` (security.token_file / security.token_env)")


def _refusing(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED without running it."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    if handler is None:  # an unknown method: refuse it the same way
        return grpc.unary_unary_rpc_method_handler(unary)
    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = [*(details.metadata or ()), (HEADER, f"Bearer {token}")]
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


def client_interceptors(token: str | None) -> list:
    """What a channel needs to present `token` on every call (none without a token)."""
    return [] if token is None else [_TokenUnaryUnary(token), _TokenUnaryStream(token)]
