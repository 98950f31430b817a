"""`python -m rolefleet.deploy.healthcheck HOST:PORT [--timeout S]`: the probe container healthchecks run.

Asks the standard grpc.health.v1 service of a role server for its overall status. Exit 0 when it
answers SERVING; otherwise exit 1 with a one-line reason (NOT_SERVING, nothing listening, no answer
in time). Every failure exits 1, usage errors too: Docker reserves exit code 2 of a healthcheck.
It imports grpc alone, not the role code: it runs every few seconds beside a loaded model.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEALTHY, UNHEALTHY = 0, 1
DEFAULT_TIMEOUT_S = 5.0
# A proxy configured in the container's environment must never see a probe of the role's own port.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def probe(address: str, timeout_s: float) -> tuple[bool, str]:
    """(whether `address` answers SERVING, a one-line account of what it answered)."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{address}: {e.code().name}: {' '.join(str(e.details()).split())}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit 2, which Docker reserves
        self.print_usage(sys.stderr)
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(UNHEALTHY)


def _address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def main(argv: Optional[list[str]] = None) -> int:
    parser = _Parser(prog="python -m rolefleet.deploy.healthcheck",
                     description="Exit 0 when the gRPC server at HOST:PORT reports SERVING, 1 otherwise.")
    parser.add_argument("address", type=_address, metavar="HOST:PORT")
    parser.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"seconds to wait for the answer (default {DEFAULT_TIMEOUT_S:g})")
    args = parser.parse_args(argv)
    serving, account = probe(args.address, args.timeout)
    print(account, file=sys.stdout if serving else sys.stderr, flush=True)
    return HEALTHY if serving else UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
