"""`rolefleet up` with a token and mutual TLS: the run's own calls present both and the run goes
on; every role refuses a plaintext caller, a caller with another CA's certificate, and a caller with
the run's certificate but no token; `rolefleet status` works with the run's certificates and token,
over gRPC and over the HTTPS control plane."""

import asyncio
import time

import grpc
import pytest

from rolefleet.certs import make_certs
from rolefleet.common.pb import actor_pb2_grpc, common_pb2
from tests.e2e.procs import (
    counter,
    processes_mentioning,
    read_metrics,
    rolefleet,
    running_run_both,
    terminate,
    write_config,
)
from tests.helpers import CONNECT_ONCE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
TOKEN = "e2e-token-0123456789abcdef"


def scrape(port: str) -> dict[str, float]:
    return {"tls": counter(port, "rolefleet_tls_refused", role="actor"),
            "token": counter(port, "rolefleet_auth_refused", role="actor", reason="missing")}


def test_a_run_with_a_token_and_mutual_tls_refuses_every_other_caller(make_config, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    certs, other = tmp_path / "certs", tmp_path / "other"
    make_certs(certs)
    make_certs(other)
    # GRPO: no critic process; the refusals are checked at the actor (every role serves through the same code).
    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=2", "train.total_steps=1000",
                      f"security.token_file={token_file}", "checkpoint.at_end=false",
                      f"security.tls.cert_file={certs}/{{role}}.pem", f"security.tls.key_file={certs}/{{role}}-key.pem",
                      f"security.tls.ca_file={certs}/ca.pem", "security.tls.mutual=true",
                      "coordinator.http_enabled=true", "coordinator.http_port=0")
    proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
    try:
        address, url = running_run_both(proc, cfg.run.out / "metrics.jsonl")
        assert url.startswith("https://127.0.0.1:")
        actor = (cfg.run.out / "logs" / "actor.log").read_text().split("serving gRPC over TLS on 127.0.0.1:")[1]
        actor, metrics_port = "127.0.0.1:" + actor.split(",")[0], actor.split("metrics on :")[1].split()[0]

        def credentials(directory):
            return grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(),
                                                (directory / "client-key.pem").read_bytes(),
                                                (directory / "client.pem").read_bytes())

        async def status(open_channel, metadata=()):
            async with open_channel() as channel:  # opened inside this call's event loop
                return await actor_pb2_grpc.ActorServiceStub(channel).GetStatus(
                    common_pb2.GetStatusRequest(), metadata=metadata, timeout=10)

        def code_of(open_channel, metadata=()):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                asyncio.run(status(open_channel, metadata))
            return err.value.code()

        bearer = (("authorization", f"Bearer {TOKEN}"),)

        # The refused callers connect once (seen in the suite's processes otherwise: 4 handshakes each over 5 s).

        def plain():
            return grpc.aio.insecure_channel(actor, options=CONNECT_ONCE)

        def foreign():
            return grpc.aio.secure_channel(actor, credentials(other), options=CONNECT_ONCE)

        def runs():
            return grpc.aio.secure_channel(actor, credentials(certs))

        assert code_of(plain, bearer) == grpc.StatusCode.UNAVAILABLE
        assert code_of(foreign, bearer) == grpc.StatusCode.UNAVAILABLE
        assert code_of(runs) == grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(status(runs, bearer)).role == "actor"

        # The CLI, each call its own process, all at once: without the token, with it over gRPC and
        # over HTTPS (each with the run's certificates: no handshake of theirs is refused). The
        # coordinator answers their role views over the channels it keeps: no new connection to the actor.
        handshakes = counter(metrics_port, "rolefleet_tls_handshakes", role="actor")
        monkeypatch.setenv("ROLEFLEET_TOKEN", "")
        denied = rolefleet("status", "--address", address, "--certs", str(certs))
        monkeypatch.setenv("ROLEFLEET_TOKEN", TOKEN)
        allowed = [rolefleet("status", *where, "--certs", str(certs)) for where in (["--address", address],
                                                                                     ["--http", url])]

        # Meanwhile: the actor counted both refused handshakes (once no call followed them) and the
        # missing token.
        deadline = time.monotonic() + 30
        while (refusals := scrape(metrics_port))["tls"] < 2:
            assert time.monotonic() < deadline, refusals
            time.sleep(0.5)
        assert refusals == {"tls": 2, "token": 1}
        # Then without certificates: its plaintext attempts are refused handshakes too (gRPC's
        # reconnects make their number vary), so it starts once the count above is read.
        uncertified = rolefleet("status", "--address", address)

        out, _ = denied.communicate(timeout=60)
        assert denied.returncode == 1 and "UNAUTHENTICATED" in out, out
        for cli in allowed:
            out, _ = cli.communicate(timeout=60)
            assert cli.returncode == 0 and "run test: RUNNING" in out, out
        out, _ = uncertified.communicate(timeout=60)
        assert uncertified.returncode == 1, out
        assert counter(metrics_port, "rolefleet_tls_handshakes", role="actor") == handshakes
        assert len(read_metrics(cfg.run.out / "metrics.jsonl")) >= 1
    finally:
        assert terminate(proc, timeout=120) == 143  # `up` ends on SIGTERM as it always does
    assert processes_mentioning(str(cfg.run.out / "config.yaml")) == []
