import asyncio

import pytest

from rolefleet.common.config import RewardSection
from rolefleet.common.pb import common_pb2, reward_pb2, reward_pb2_grpc
from rolefleet.common.roles import open_channel
from rolefleet.reward import server as reward_server
from rolefleet.reward.client import GrpcRewardClient
from rolefleet.reward.core import RewardCore, ScoreItem
from rolefleet.reward.functions import REWARD_FUNCTIONS
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
