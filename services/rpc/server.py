"""One bootstrap for every role server: grpc.aio + health + reflection + /metrics + ordered shutdown.

A role supplies a servicer (methods wrapped by `rpc` / `rpc_stream`, which apply the one
exception-to-status mapping and record RPC metrics) and a `close()` for its core. `serve()` starts it
on the configured (or an ephemeral) port, reports the bound ports in an optional ready file, and on
SIGTERM/SIGINT shuts down in order: NOT_SERVING, `stop(grace)`, metrics server, core (frees the GPU).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from rolefleet.common import metrics, oom
from rolefleet.common.config import Endpoint
from rolefleet.common.errors import status_for
from rolefleet.common.role_types import INSTANCE_ID
from rolefleet.rpc.channels import message_options
from rolefleet.rpc.guard import GuardInterceptor
from rolefleet.rpc.security import OPEN, Security
from rolefleet.rpc.tls import ServerTls

log = logging.getLogger(__name__)

def server_options(security: Security) -> list[tuple[str, Any]]:
    # gRPC sets SO_REUSEPORT by default, which lets a second server bind a busy port and silently share
    # (or steal) its traffic: a stale actor would keep answering a new run. A busy port must fail.
    # One connection may not open more streams than one client may run calls.
    return [*message_options(security.max_message_bytes), ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", security.max_calls_per_client)]


SHUTDOWN_GRACE_S = 10.0


class StartupError(RuntimeError):
    """A server cannot start (e.g. its port is in use); the message says which and why."""


def _fail(role: str, method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, torch.OutOfMemoryError):  # RESOURCE_EXHAUSTED naming the phase and its settings
        exc = oom.explain(role, method, exc)
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s.%s failed", role, method)
    else:
        log.warning("%s.%s rejected: %s", role, method, message)
    return code, message


def _received(servicer: RoleServicer, method: Callable, request) -> tuple[str, float, grpc.StatusCode]:
    servicer.requests_served += 1
    metrics.RPC_RECEIVED_BYTES.labels(servicer.role, method.__name__).inc(request.ByteSize())
    return method.__name__, time.perf_counter(), grpc.StatusCode.OK


def rpc(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Wrap a unary servicer method: map exceptions to statuses and record RPC metrics."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        name, start, code = _received(self, method, request)
        try:
            response = await method(self, request, context)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the client went away or its deadline passed
            raise
        except Exception as exc:  # noqa: BLE001 - the one place exceptions become statuses
            code, message = _fail(self.role, name, exc)
            await context.abort(code, message)
        finally:
            metrics.RPC_SECONDS.labels(self.role, name, code.name).observe(time.perf_counter() - start)
        metrics.RPC_SENT_BYTES.labels(self.role, name).inc(response.ByteSize())
        return response

    return wrapper


def rpc_stream(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Like `rpc`, for server-streaming methods (async generators)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        name, start, code = _received(self, method, request)
        try:
            async for response in method(self, request, context):
                metrics.RPC_SENT_BYTES.labels(self.role, name).inc(response.ByteSize())
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001
            code, message = _fail(self.role, name, exc)
            await context.abort(code, message)
        finally:
            metrics.RPC_SECONDS.labels(self.role, name, code.name).observe(time.perf_counter() - start)

    return wrapper


class RoleServicer:
    """Base of every servicer: names the role for metrics, counts the requests it served, and
    answers GetStatus from its core's `status(include_digest)`."""

    role = "role"
    requests_served = 0
    core: Any

    @rpc
    async def GetStatus(self, request, context):
        # Cheap by default: no weight hashing, so it never waits behind the model lock (a rollout or
        # an update can hold it for minutes); the digest only on request, off the event loop.
        if request.include_weights_digest:
            status = await asyncio.to_thread(self.core.status, True)
        else:
            status = self.core.status(False)
        message = status.to_proto()
        message.requests_served = self.requests_served
        return message


class TrainerServicer(RoleServicer):
    """The RPCs every training role (actor, critic) answers alike: its checkpoints."""

    @rpc
    async def SaveCheckpoint(self, request, context):
        info = await asyncio.to_thread(self.core.save_checkpoint, request.step, request.path,
                                        request.background)
        return info.to_proto()

    @rpc
    async def LoadCheckpoint(self, request, context):
        info = await asyncio.to_thread(self.core.load_checkpoint, request.path)
        return info.to_proto()


@dataclass
class RoleServer:
    role: str
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    grpc_port: int
    metrics_port: int
    _httpd: Any
    services: tuple[str, ...] = ()  # the health service's names: "" and each gRPC service
    tls: Optional[ServerTls] = None

    async def report_broken(self, broken: Callable[[], str], period_s: float = 1.0) -> None:
        """Once `broken()` names why the role refuses updates until restarted, health answers
        NOT_SERVING (for the server and each service): compose's health checks and Kubernetes'
        liveness probes restart it, instead of a run retrying a role that can only refuse."""
        while not (why := broken()):
            await asyncio.sleep(period_s)
        log.error("%s refuses updates until restarted (%s): reporting NOT_SERVING", self.role, why)
        for name in self.services:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        metrics.HEALTH.labels(self.role).set(0)

    async def stop(self, close: Optional[Callable[[], None]] = None) -> None:
        """Ordered shutdown: NOT_SERVING first so balancers drain, then finish in-flight calls."""
        metrics.HEALTH.labels(self.role).set(0)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(SHUTDOWN_GRACE_S)
        self._httpd.shutdown()
        self._httpd.server_close()
        if self.tls is not None:
            self.tls.close()
        if close is not None:
            # Off the loop: closing may wait for a rollout thread to let go of the model.
            await asyncio.to_thread(close)


def check_ports_free(role: str, endpoint: Endpoint) -> None:
    """Fail fast, before a role spends minutes loading models, when a fixed port is already taken.
    The real bind still refuses a port taken in between (no port reuse)."""
    for kind, port in (("gRPC", endpoint.port), ("metrics", endpoint.metrics_port)):
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is free
            try:
                probe.bind((endpoint.host, port))
            except OSError as exc:
                raise StartupError(busy_port_error(role, kind, endpoint.host, port, exc)) from None


def busy_port_error(role: str, kind: str, host: str, port: int, exc: BaseException) -> str:
    # gRPC's bind error carries no errno; an OSError from the metrics server or the probe does.
    reason = getattr(exc, "strerror", None) or "the port is in use or the address is not available here"
    return (f"{role}: cannot listen for {kind} on {host}:{port}: {reason}. Another process holds the port "
            f"(a server left from an earlier run?); stop it or pick another {role}."
            f"{ {'gRPC': 'port', 'metrics': 'metrics_port'}.get(kind, kind + '_port')}")


async def start_server(
    role: str,
    endpoint: Endpoint,
    add_servicers: Callable[[grpc.aio.Server], list[str]],
    security: Security = OPEN,
) -> RoleServer:
    """Start a role's server; `add_servicers` registers its services and returns their full names.
    `security` says what callers must present (token, TLS; rpc/guard.py). A port that cannot be
    bound raises StartupError and leaves nothing running."""
    tls = ServerTls(role, security.tls) if security.tls else None
    guard = GuardInterceptor(role, security.token, security.max_calls_per_client, tls)
    server = grpc.aio.server(options=server_options(security), interceptors=[guard])
    names = add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    # Metrics first: an HTTP server can be closed again for sure, a bound but unstarted gRPC server
    # keeps its port until it is garbage collected.
    try:
        httpd, _ = start_http_server(endpoint.metrics_port, addr=endpoint.host)
    except OSError as exc:
        raise StartupError(busy_port_error(role, "metrics", endpoint.host, endpoint.metrics_port, exc)) from None
    address = f"{endpoint.host}:{endpoint.port}"
    try:
        port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError("no port bound")
    except RuntimeError as exc:  # grpc raises this when the bind fails
        httpd.shutdown()
        httpd.server_close()
        raise StartupError(busy_port_error(role, "gRPC", endpoint.host, endpoint.port, exc)) from None
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics.HEALTH.labels(role).set(1)
    warn_if_exposed(role, "gRPC", endpoint.host, security)
    log.info("%s serving gRPC%s on %s:%d, metrics on :%d", role, " over TLS" if tls else "", endpoint.host, port,
             httpd.server_port)
    return RoleServer(role, server, health_servicer, port, httpd.server_port, httpd, ("", *names), tls)


def warn_if_exposed(role: str, what: str, host: str, security: Security) -> None:
    """A server on every interface in plaintext: anyone on the network reads its traffic, and
    without a token may call it."""
    if host in ("0.0.0.0", "::", "") and security.tls is None:
        log.warning("%s: %s listens on all interfaces (%s) without TLS%s; set security.tls (docs/security.md) "
                    "or bind 127.0.0.1", role, what, host or "*", "" if security.token else " or a token")


def write_ready_file(path: str | Path, handle: RoleServer, **extra: Any) -> None:
    """Publish the bound ports atomically, so a supervisor never reads a half-written file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"role": handle.role, "pid": os.getpid(), "instance_id": INSTANCE_ID,
                               "grpc_port": handle.grpc_port, "metrics_port": handle.metrics_port, **extra}))
    tmp.replace(path)


async def serve_until_stopped(
    handle: RoleServer,
    close: Optional[Callable[[], None]] = None,
    work: Optional[Awaitable[Any]] = None,
    on_signal: Optional[Callable[[], bool]] = None,
) -> Any:
    """Serve until SIGTERM/SIGINT, or until `work` (the coordinator's run) completes; then stop.

    With `work`, a first signal calls `on_signal`, which asks the run to stop at a consistent point
    and returns True when there is nothing to keep consistent yet (cancel at once); a second signal
    cancels the work regardless. A cancelled work returns None.
    """
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    task = asyncio.ensure_future(work) if work is not None else None
    signals = 0

    def _signalled() -> None:
        nonlocal signals
        signals += 1
        log.info("%s: shutdown signal received", handle.role)
        cancel_now = on_signal() if on_signal is not None and signals == 1 else True
        if task is not None and cancel_now:
            task.cancel()
        stopped.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _signalled)
    try:
        if task is None:
            await stopped.wait()
            return None
        try:
            return await task
        except asyncio.CancelledError:
            if not stopped.is_set():
                raise  # cancelled from outside, not by a signal
            return None
    finally:
        await handle.stop(close)
