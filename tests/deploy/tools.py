"""The command-line tools the deploy checks run (helm, promtool, prometheus, docker-compose):
installed by the project (`make tools`, and the venv's dev extras), never assumed on the machine.
And what the probe checks share: the probe as its containers run it, a TLS server to probe."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

REPO = Path(__file__).resolve().parents[2]
SEARCH = os.pathsep.join([str(REPO / ".tools" / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def tool(name: str) -> str:
    """The path of `name`, or a test failure that says how to install it."""
    found = shutil.which(name, path=SEARCH)
    if found is None:
        pytest.fail(f"{name} is not installed: `make tools` installs helm and prometheus (promtool); "
                    "the venv's dev extras install docker-compose")
    return found


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    """`python -m rolefleet.deploy.healthcheck ARGS`, as a container healthcheck runs it."""
    return subprocess.run([sys.executable, "-m", "rolefleet.deploy.healthcheck", *args],
                          capture_output=True, text=True, timeout=30)


async def mutual_tls_health_server(certs: Path, role: str = "reward") -> tuple[grpc.aio.Server, int]:
    """A gRPC server on 127.0.0.1 presenting `role`'s certificate of `certs` (what `rolefleet certs`
    wrote) that takes only TLS clients with a certificate of the same CA, serving the standard
    health service (SERVING); (the server, its port)."""
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    credentials = grpc.ssl_server_credentials([((certs / f"{role}-key.pem").read_bytes(),
                                                (certs / f"{role}.pem").read_bytes())],
                                              root_certificates=(certs / "ca.pem").read_bytes(),
                                              require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port
