import asyncio
import math
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
import yaml

from rolefleet.common import codec
from rolefleet.common.config import RewardSection
from rolefleet.common.errors import RoleFleetError
from rolefleet.common.pb import common_pb2, reward_pb2, reward_pb2_grpc
from rolefleet.reward import server as reward_server
from rolefleet.reward.client import GrpcRewardClient, InProcessRewardClient, from_proto
from rolefleet.reward.core import RewardCore
from rolefleet.reward.types import ScoreItem, ScoreResult
from rolefleet.rpc.roles import open_channel
from tests.e2e.procs import children_of, rolefleet, terminate, wait_ready
from tests.helpers import expect_code, expect_invalid, serving

USER_FILE = Path(__file__).with_name("user_rewards.py")


def test_score_over_grpc_and_malformed_request():
    core = RewardCore(RewardSection(sources=[{"function": "exact_match"},
                                             {"function": "regex", "pattern": "[0-9]", "weight": 0.5}]))

    async def scenario():
        async with serving("reward", lambda s: reward_server.add_to_server(core, s)) as address:
            client = GrpcRewardClient(address, timeout_s=10)
            result = await client.score([ScoreItem("1+1=", "2", "2"), ScoreItem("1+2=", "four", "3")])
            assert result.total.tolist() == [1.5, 0.0] and result.errors == ["", ""]
            assert {k: v.tolist() for k, v in result.sources.items()} == {"exact_match": [1.0, 0.0],
                                                                         "regex": [1.0, 0.0]}
            async with open_channel(address) as channel:
                stub = reward_pb2_grpc.RewardServiceStub(channel)
                await expect_invalid(stub.Score(reward_pb2.ScoreRequest()), "items")
                for bad, why in (("{not json", "not JSON"), ("[1, 2]", "a JSON object is expected, got list")):
                    item = reward_pb2.ScoreItem(prompt="p", response="r", ground_truth="g", extra_json=bad)
                    message = await expect_invalid(stub.Score(reward_pb2.ScoreRequest(items=[item])),
                                                   "items[0].extra_json")
                    assert why in message
                status = await stub.GetStatus(common_pb2.GetStatusRequest())
                assert status.requests_served == 5  # Score, three rejected Scores, this GetStatus
            assert core.scored == 2  # the bad requests scored nothing
            assert (await client.score([ScoreItem("p", "x", "x")])).total.tolist() == [1.0]
            await client.close()

    asyncio.run(scenario())


def test_extra_travels_to_the_functions_and_both_clients_agree(monkeypatch):
    from rolefleet.reward.functions import REWARD_FUNCTIONS

    monkeypatch.setitem(REWARD_FUNCTIONS._items, "from_extra",
                        lambda p, r, t, extra: extra["weights"][r] if r in extra["weights"] else 1 / 0)
    core = RewardCore(RewardSection(function="from_extra", fallback_score=-1.0))
    extra = {"weights": {"a": 0.25, "b": 3}, "note": "é"}
    items = [ScoreItem("p", "a", "", extra), ScoreItem("p", "c", "", extra), ScoreItem("p", "b", "", extra)]

    async def scenario():
        async with serving("reward", lambda s: reward_server.add_to_server(core, s)) as address:
            over_grpc = await GrpcRewardClient(address, timeout_s=10).score(items)
        in_process = await InProcessRewardClient(core).score(items)
        for result in (over_grpc, in_process):
            assert result.total.tolist() == [0.25, -1.0, 3.0]
            assert result.errors == ["", "from_extra: raised ZeroDivisionError: division by zero", ""]
            assert math.isnan(result.sources["from_extra"][1])

    asyncio.run(scenario())


def test_request_limits_of_the_reward_role():
    core = RewardCore(RewardSection(max_items_per_request=2, max_item_bytes=16))

    async def scenario():
        async with serving("reward", lambda s: reward_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = reward_pb2_grpc.RewardServiceStub(channel)
                item = reward_pb2.ScoreItem(prompt="1+1=", response="2", ground_truth="2")
                await expect_code(stub.Score(reward_pb2.ScoreRequest(items=[item] * 3)),
                                  grpc.StatusCode.RESOURCE_EXHAUSTED, "items", "reward.max_items_per_request=2")
                big = reward_pb2.ScoreItem(prompt="x" * 100, response="2", ground_truth="2")
                await expect_code(stub.Score(reward_pb2.ScoreRequest(items=[item, big])),
                                  grpc.StatusCode.RESOURCE_EXHAUSTED, "items[1]", "reward.max_item_bytes=16")
                noted = reward_pb2.ScoreItem(prompt="1", response="2", ground_truth="2", extra_json='{"a": "xxxxxxxxxx"}')
                await expect_code(stub.Score(reward_pb2.ScoreRequest(items=[noted])),
                                  grpc.StatusCode.RESOURCE_EXHAUSTED, "items[0]", "reward.max_item_bytes=16")
                reply = await stub.Score(reward_pb2.ScoreRequest(items=[item]))
                assert reply.scores.shape == [1] and list(reply.errors) == [""]
        assert core.scored == 1

    asyncio.run(scenario())


def response_of(total, sources, errors) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(
        scores=codec.encode(torch.tensor(total, dtype=torch.float32)),
        sources=[reward_pb2.SourceScores(name=n, scores=codec.encode(torch.tensor(s, dtype=torch.float32)))
                 for n, s in sources],
        errors=errors)


def test_the_client_refuses_a_response_that_does_not_match_the_items():
    good = from_proto(response_of([1.0, 2.0], [("a", [1.0, 2.0])], ["", "a: broke"]), 2)
    assert isinstance(good, ScoreResult) and good.failed == 1
    for response, why in [
        (response_of([1.0], [("a", [1.0, 2.0])], ["", ""]), "total is torch.float32 (1,), expected float32 (2,)"),
        (response_of([1.0, 2.0], [("a", [1.0])], ["", ""]), "sources['a'] is torch.float32 (1,)"),
        (response_of([1.0, 2.0], [("a", [1.0, 2.0])], [""]), "1 error entries for 2 items"),
        (response_of([1.0, 2.0], [("a", [1.0, 2.0]), ("a", [1.0, 2.0])], ["", ""]), "a source name appears twice"),
    ]:
        with pytest.raises(RoleFleetError, match="reward server sent a malformed result for 2 items: ") as err:
            from_proto(response, 2)
        assert why in str(err.value)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "{"):
            found = dict(pair.split("=", 1) for pair in series[len(name) + 1:-1].split(","))
            if found == {k: f'"{v}"' for k, v in labels.items()}:
                return float(value)
    return 0.0


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_real_reward_server_answers_misbehaving_user_functions_with_per_sample_errors(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"model_name_or_path": str(tmp_path / "no-model")},  # the reward role loads no model
        "reward": {"sources": [
            {"name": "correct", "kind": "function", "function": "math"},
            {"name": "mine", "kind": "user", "path": f"{USER_FILE}:misbehave", "weight": 0.5},
            # The timeout leaves room for a replaced worker to start on a loaded machine and run
            # the next item (alloc) to its MemoryError: 3 s was too little once in `make test`
            # (three test processes on 2 cores).
        ], "user_workers": 2, "user_timeout_s": 8.0, "user_memory_mb": 512, "fallback_score": -1.0},
    }))
    ready = tmp_path / "ready.json"
    proc = rolefleet("serve", "reward", "--config", str(config), "--ready-file", str(ready))
    try:
        ports = wait_ready(proc, ready)
        workers = children_of(proc.pid)
        assert len(workers) == 2

        async def scenario():
            client = GrpcRewardClient(f"127.0.0.1:{ports['grpc_port']}", timeout_s=30)
            bad = ["raise", "sleep", "exit", "alloc", "text"]
            items = [ScoreItem("q", "\\boxed{\\frac{1}{2}}", "#### 0.5"), *[ScoreItem("q", r, "1") for r in bad]]
            result = await client.score(items)
            assert result.errors[0] == "" and result.total[0] == 1.0 + 0.5 * len(items[0].response)
            assert [e.split(":")[0] for e in result.errors[1:]] == ["mine"] * len(bad)
            assert "timed out after 8 s" in result.errors[2] and "exited with code 7" in result.errors[3]
            assert "MemoryError" in result.errors[4] and "not a number" in result.errors[5]
            assert result.total[1:].tolist() == [0.5 * -1.0] * len(bad)  # math scored 0, mine the fallback
            start = time.monotonic()
            again = await client.score([ScoreItem("q", "The answer is 0.5", "1/2")])
            # Answered by a free worker: sooner than the 8 s a hung one would cost.
            assert again.total.tolist() == [1.0 + 0.5 * 17] and time.monotonic() - start < 8.0
            await client.close()

        asyncio.run(scenario())
        url = f"http://127.0.0.1:{ports['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        assert metric(text, "rolefleet_reward_errors_total", role="reward", function="mine") == 5.0
        assert metric(text, "rolefleet_reward_errors_total", role="reward", function="correct") == 0.0
        assert metric(text, "rolefleet_samples_scored_total", role="reward") == 7.0
        alive = children_of(proc.pid)
        assert len(alive) == 2 and set(alive) != set(workers)  # the dead and the hung were replaced
    finally:
        assert terminate(proc) == 0
    deadline = time.monotonic() + 10  # its workers end with it
    while left := [pid for pid in alive if Path(f"/proc/{pid}").exists()]:
        assert time.monotonic() < deadline, left
        time.sleep(0.1)


def test_a_name_with_several_addresses_spreads_score_calls_over_them():
    """What a headless Kubernetes Service of reward replicas resolves to: the client's channels
    balance round robin, so both servers get calls (once both connections are up: calls go to the
    ready ones, so on a loaded machine the first few may all go to one)."""
    cores = [RewardCore(RewardSection()), RewardCore(RewardSection())]

    async def scenario() -> int:
        async with serving("reward", lambda s: reward_server.add_to_server(cores[0], s)) as a, \
                serving("reward", lambda s: reward_server.add_to_server(cores[1], s)) as b:
            client = GrpcRewardClient(f"ipv4:{a},{b}", 10)
            try:
                for calls in range(1, 201):
                    await client.score([ScoreItem("1+1=", "2", "2")])
                    if calls >= 8 and cores[0].scored and cores[1].scored:
                        return calls
            finally:
                await client.close()
        return calls

    calls = asyncio.run(scenario())
    assert cores[0].scored > 0 and cores[1].scored > 0 and cores[0].scored + cores[1].scored == calls
