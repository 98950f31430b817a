"""FastAPI apps (or ASGI apps in front of one, `http_direct.py`) served by uvicorn inside a role
server's event loop, beside its gRPC server: the coordinator's HTTP control plane and the actor's
OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from rolefleet.common.config import TlsSection


class _Server(uvicorn.Server):
    """uvicorn inside a role server's loop: the role owns the process's signals (SIGTERM stops it
    in order), so uvicorn must not install its own handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The app bound to `host:port` (0: a free port, known once bound) and served as a task; over
    TLS with `tls` (`role`'s certificate; mutual TLS asks each client for one of the CA's)."""

    def __init__(self, app: ASGIApp, host: str, port: int, tls: TlsSection | None = None, role: str = "coordinator",
                 name: str = "http-control-plane"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on sockets that say they are TCP
        # (a connection inherits this one's proto); with it on, a kept-alive connection's every
        # answer waited 40 ms for the client's delayed ACK (uvicorn writes head and body apart).
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))  # OSError when taken: the caller reports it
        self.host, self.port = host, self.socket.getsockname()[1]
        self.scheme = "https" if tls is not None and tls.enabled else "http"
        self.server = _Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                             **_uvicorn_tls(tls, role)))
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]), name=name)

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.socket.close()


def _uvicorn_tls(tls: TlsSection | None, role: str) -> dict[str, Any]:
    if tls is None or not tls.enabled:
        return {}
    files = tls.paths(role)
    mutual = {"ssl_ca_certs": files["ca_file"], "ssl_cert_reqs": ssl.CERT_REQUIRED} if tls.mutual else {}
    return {"ssl_certfile": files["cert_file"], "ssl_keyfile": files["key_file"], **mutual}
