"""Token authentication of the gRPC role servers (issue 14; DESIGN "Security").

Every role of a run shares one secret token. A server with a token refuses any call whose
`authorization` metadata is not `Bearer <token>` with UNAUTHENTICATED (rpc/guard.py), except the
standard health service: compose health checks and Kubernetes probes carry no secret. Tokens are
compared in constant time, never logged, and each refusal is counted (`rolefleet_auth_refused_total`,
by role and reason). A client attaches the token to every call through the interceptors below.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import grpc
from prometheus_client import Counter

AUTH_REFUSED = Counter("rolefleet_auth_refused", "Calls refused for want of the run's token", ["role", "reason"])
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


def write_run_token(path: Path) -> Path:
    """A new random token in `path`, readable by its owner alone (0600 from the moment it exists:
    the file is created with that mode, never chmod-ed after the secret is in it). An older file
    there (another run's) is replaced. Returns the absolute path."""
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    tmp.replace(path)
    return path


def token_matches(metadata, token: str) -> str | None:
    """None when `metadata` carries the token; else why not ("missing" or "wrong")."""
    presented = dict(metadata or ()).get(HEADER)
    if presented is None:
        return "missing"
    expected = f"Bearer {token}".encode()
    given = presented.encode() if isinstance(presented, str) else bytes(presented)
    return None if hmac.compare_digest(given, expected) else "wrong"


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
