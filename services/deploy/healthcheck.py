"""`python -m rolefleet.deploy.healthcheck HOST:PORT [--timeout S] [--ca FILE] [--cert FILE --key FILE]
[--server-name NAME]`: the probe container healthchecks (and Kubernetes exec probes) run.

Asks the standard grpc.health.v1 service of a role server for its overall status. Exit 0 when it
answers SERVING; otherwise exit 1 with a one-line reason (NOT_SERVING, nothing listening, no answer
in time, a refused TLS handshake, an unreadable certificate file). Every failure exits 1, usage
errors too: Docker reserves exit code 2 of a healthcheck. It imports grpc alone, not the role code:
it runs every few seconds beside a loaded model.

A server with security.tls on takes TLS only: --ca (the CA that signed the server's certificate)
and/or --cert with --key turn TLS on; --cert and --key also present a client certificate, which a
server under mutual TLS requires (a role's own certificate serves as one). The health service asks
for no token.
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


class FileError(Exception):
    """A certificate or key file that cannot be read; the message names the flag and the file."""


def read_pem(flag: str, path: Optional[str]) -> Optional[bytes]:
    """The PEM file `path` given to `flag`, or None when the flag is absent."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise FileError(f"{flag}: cannot read {path} ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise FileError(f"{flag}: {path} is not a PEM file")
    return data


def channel_credentials(ca: Optional[bytes], cert: Optional[bytes], key: Optional[bytes]) -> grpc.ChannelCredentials:
    """TLS that verifies the server against `ca` (the system's roots without one) and presents
    `cert` and `key` as a client certificate when given."""
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def probe(address: str, timeout_s: float, credentials: Optional[grpc.ChannelCredentials] = None,
          server_name: Optional[str] = None) -> tuple[bool, str]:
    """(whether `address` answers SERVING, a one-line account of what it answered). With
    `credentials` the channel is TLS; `server_name` replaces the dialled host in the certificate check."""
    options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", server_name)] if server_name else [])
    with (grpc.secure_channel(address, credentials, options=options) if credentials is not None
          else grpc.insecure_channel(address, options=options)) as channel:
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
    tls = parser.add_argument_group("TLS (a server with security.tls on)")
    tls.add_argument("--ca", metavar="FILE", help="PEM CA certificate(s) that verify the server's certificate; "
                     "without it, the system's roots")
    tls.add_argument("--cert", metavar="FILE", help="PEM client certificate to present (mutual TLS); with --key")
    tls.add_argument("--key", metavar="FILE", help="PEM private key of --cert")
    tls.add_argument("--server-name", metavar="NAME",
                     help="name to check in the server's certificate instead of HOST (security.tls.server_name)")
    args = parser.parse_args(argv)
    if (args.cert is None) != (args.key is None):
        parser.error("--cert and --key go together")
    use_tls = any(f is not None for f in (args.ca, args.cert, args.key))
    if args.server_name is not None and not use_tls:
        parser.error("--server-name needs TLS: give --ca, or --cert and --key")
    credentials = None
    if use_tls:
        try:
            credentials = channel_credentials(*(read_pem(flag, path) for flag, path in (
                ("--ca", args.ca), ("--cert", args.cert), ("--key", args.key))))
        except FileError as e:
            print(f"{args.address}: {e}", file=sys.stderr, flush=True)
            return UNHEALTHY
    serving, account = probe(args.address, args.timeout, credentials, args.server_name)
    print(account, file=sys.stdout if serving else sys.stderr, flush=True)
    return HEALTHY if serving else UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
