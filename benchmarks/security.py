"""What the run's security costs a call: the same unary call carrying a step-sized payload to a
role server, plaintext without a token against the token, TLS and mutual TLS (rpc/guard.py,
rpc/tls.py), side by side in one process. Prints the median milliseconds per call of each and
the ratio to plaintext.

    python benchmarks/security.py [--mb 1,16] [--calls 200] [--out results.json]

A step's batch is small next to the compute (256 x 1k tokens of int64 ids: about 2 MB with its
lengths and per-token floats), so 1 MB and 16 MB bracket what a role server receives per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from rolefleet.certs import make_certs
from rolefleet.common.config import Endpoint, SecuritySection, TlsSection
from rolefleet.rpc.roles import open_channel, use_security
from rolefleet.rpc.security import OPEN, Security
from rolefleet.rpc.server import start_server

TOKEN = "benchmark-token-0123456789"


async def echo(request: bytes, context) -> bytes:
    return request[:16]  # the request is what travels; the answer stays small, as an Update's does


def add_echo(server: grpc.aio.Server) -> list[str]:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    return ["bench.Echo"]


def settings(certs: Path) -> dict[str, tuple[Security, Security]]:
    """(what the server demands, what the client presents) of each setting."""
    def tls(role: str, mutual: bool) -> Security:
        section = SecuritySection(tls=TlsSection(cert_file=f"{certs}/{{role}}.pem", key_file=f"{certs}/{{role}}-key.pem",
                                                 ca_file=f"{certs}/ca.pem", mutual=mutual))
        return Security(TOKEN, Security.of(section, role).tls)

    token = Security(TOKEN)
    return {"plaintext": (OPEN, OPEN), "token": (token, token),
            "token + TLS": (tls("actor", False), tls("client", False)),
            "token + mutual TLS": (tls("actor", True), tls("client", True))}


async def median_ms(server_side: Security, client_side: Security, payload: bytes, calls: int) -> float:
    handle = await start_server("bench", Endpoint(port=0, metrics_port=0), add_echo, server_side)
    use_security(client_side)
    try:
        async with open_channel(f"127.0.0.1:{handle.grpc_port}") as channel:
            call = channel.unary_unary("/bench.Echo/Echo")
            for _ in range(5):  # connect, handshake, warm up
                await call(payload, timeout=30)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                await call(payload, timeout=30)
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000
    finally:
        use_security(OPEN)
        await handle.stop()


async def main(sizes_mb: list[float], calls: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        make_certs(Path(tmp))
        rows = []
        for mb in sizes_mb:
            payload = bytes(int(mb * 1024 * 1024))
            base = None
            for name, (server_side, client_side) in settings(Path(tmp)).items():
                ms = await median_ms(server_side, client_side, payload, calls)
                base = base or ms
                rows.append({"mb": mb, "setting": name, "median_ms": round(ms, 3), "ratio": round(ms / base, 2)})
                print(f"{mb:>6g} MB  {name:<20} {ms:8.2f} ms  {ms / base:5.2f}x plaintext", flush=True)
        return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="1,16", help="payload sizes in MiB, comma separated")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per setting and size")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    results = asyncio.run(main([float(x) for x in args.mb.split(",")], args.calls))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
