"""`rolefleet up` with a token: the run's own calls carry it and the run finishes; a caller
without it is refused by every role (UNAUTHENTICATED), and `rolefleet status` works with it."""

import asyncio

import grpc
import pytest

from rolefleet.common.pb import actor_pb2_grpc, common_pb2
from tests.e2e.procs import processes_mentioning, read_metrics, rolefleet, running_run, terminate, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
TOKEN = "e2e-token-0123456789abcdef"


def test_a_run_with_a_token_refuses_callers_without_it(make_config, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cfg = make_config("train.total_steps=1000", f"security.token_file={token_file}", "checkpoint.at_end=false")
    proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
    try:
        address = running_run(proc, cfg.run.out / "metrics.jsonl")
        actor_port = (cfg.run.out / "logs" / "actor.log").read_text().split("serving gRPC on 127.0.0.1:")[1].split(",")[0]

        async def call(metadata):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{actor_port}") as channel:
                return await actor_pb2_grpc.ActorServiceStub(channel).GetStatus(
                    common_pb2.GetStatusRequest(), metadata=metadata, timeout=10)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(call(()))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(call((("authorization", f"Bearer {TOKEN}"),))).role == "actor"

        monkeypatch.setenv("ROLEFLEET_TOKEN", "")
        denied = rolefleet("status", "--address", address)
        out, _ = denied.communicate(timeout=60)
        assert denied.returncode == 1 and "UNAUTHENTICATED" in out, out
        monkeypatch.setenv("ROLEFLEET_TOKEN", TOKEN)
        allowed = rolefleet("status", "--address", address)
        out, _ = allowed.communicate(timeout=60)
        assert allowed.returncode == 0 and "run test: RUNNING" in out, out
        assert len(read_metrics(cfg.run.out / "metrics.jsonl")) >= 1
    finally:
        assert terminate(proc, timeout=120) == 143  # `up` ends on SIGTERM as it always does
    assert processes_mentioning(str(cfg.run.out / "config.yaml")) == []
