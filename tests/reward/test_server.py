import asyncio

import pytest

from rolefleet.common import metrics
from rolefleet.common.config import RewardSection
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.pb import common_pb2, reward_pb2, reward_pb2_grpc
from rolefleet.common.roles import open_channel
from rolefleet.reward import server as reward_server
from rolefleet.reward.client import GrpcRewardClient
from rolefleet.reward.core import RewardCore
from rolefleet.reward.functions import REWARD_FUNCTIONS
from rolefleet.reward.types import ScoreItem
from tests.helpers import expect_invalid, serving


@pytest.mark.parametrize(
    "name, response, truth, expected",
    [
        ("exact_match", "12", "12", 1.0),
        ("exact_match", " 12 ", "12", 1.0),
        ("exact_match", "121", "12", 0.0),
        ("numeric_match", "it is 12.0!", "12", 1.0),
        ("numeric_match", "no number", "12", 0.0),
        ("numeric_match", "12", "not a number", 0.0),
    ],
)
def test_rule_based_functions(name, response, truth, expected):
    assert REWARD_FUNCTIONS.get(name)("p", response, truth) == expected


def test_unknown_function_is_a_config_error_listing_valid_names():
    from rolefleet.common.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="reward.function: unknown reward function 'nope'; valid: exact_match"):
        parse_config({"model": {"model_name_or_path": "m"}}, ["reward.function=nope"])


def test_score_over_grpc_and_malformed_request():
    core = RewardCore(RewardSection(function="exact_match"))

    async def scenario():
        async with serving("reward", lambda s: reward_server.add_to_server(core, s)) as address:
            client = GrpcRewardClient(address, timeout_s=10)
            scores = await client.score([ScoreItem("1+1=", "2", "2"), ScoreItem("1+2=", "4", "3")])
            assert scores.tolist() == [1.0, 0.0]
            async with open_channel(address) as channel:
                stub = reward_pb2_grpc.RewardServiceStub(channel)
                await expect_invalid(stub.Score(reward_pb2.ScoreRequest()), "items")
                status = await stub.GetStatus(common_pb2.GetStatusRequest())
                assert status.requests_served == 3  # Score, the rejected Score, this GetStatus
            assert core.scored == 2  # the bad request scored nothing
            assert (await client.score([ScoreItem("p", "x", "x")])).tolist() == [1.0]
            await client.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "returned, shown",
    [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"), ("1.0", "'1.0'"), (None, "None"),
     (1e39, "1e+39")],
)
def test_a_non_finite_or_non_numeric_reward_is_refused_naming_the_sample_and_function(monkeypatch, returned,
                                                                                         shown):
    def flaky(prompt, response, truth):
        return returned if response == "bad" else 1.0

    monkeypatch.setitem(REWARD_FUNCTIONS._items, "flaky", flaky)
    core = RewardCore(RewardSection.model_construct(function="flaky", max_items_per_request=8,
                                                    max_item_bytes=1024))
    errors = metrics.REWARD_ERRORS.labels("reward", "flaky")
    counted = errors._value.get()
    with pytest.raises(InvalidArgument) as err:
        core.score([ScoreItem("p", "ok", "x"), ScoreItem("p", "bad", "x")])
    assert err.value.field == "items[1]"
    assert f"reward function 'flaky' returned {shown}, not a finite number" in str(err.value)
    assert errors._value.get() == counted + 1 and core.scored == 0  # counted; nothing scored
    assert core.score([ScoreItem("p", "ok", "x")]).tolist() == [1.0]  # still serving


def test_a_reward_function_that_raises_is_that_samples_error(monkeypatch):
    def broken(prompt, response, truth):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(REWARD_FUNCTIONS._items, "broken", broken)
    core = RewardCore(RewardSection.model_construct(function="broken", max_items_per_request=8,
                                                    max_item_bytes=1024))

    async def scenario():
        async with serving("reward", lambda s: reward_server.add_to_server(core, s)) as address:
            async with open_channel(address) as channel:
                stub = reward_pb2_grpc.RewardServiceStub(channel)
                item = reward_pb2.ScoreItem(prompt="p", response="r", ground_truth="g")
                await expect_invalid(stub.Score(reward_pb2.ScoreRequest(items=[item])),
                                     "items[0]: reward function 'broken' raised ZeroDivisionError")

    asyncio.run(scenario())


def test_request_limits_of_the_reward_role():
    import grpc

    from tests.helpers import expect_code

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
                reply = await stub.Score(reward_pb2.ScoreRequest(items=[item]))
                assert reply.scores.shape == [1]
        assert core.scored == 1

    asyncio.run(scenario())
