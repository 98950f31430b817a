"""The reward role's thin gRPC shell."""

from __future__ import annotations

import asyncio

import grpc

from rolefleet.common import codec
from rolefleet.common.pb import reward_pb2, reward_pb2_grpc
from rolefleet.common.server import RoleServicer, rpc
from rolefleet.reward.core import RewardCore
from rolefleet.reward.types import ScoreItem


class RewardServicer(RoleServicer, reward_pb2_grpc.RewardServiceServicer):
    role = "reward"

    def __init__(self, core: RewardCore):
        self.core = core

    @rpc
    async def Score(self, request: reward_pb2.ScoreRequest, context):
        items = [ScoreItem(i.prompt, i.response, i.ground_truth) for i in request.items]
        scores = await asyncio.to_thread(self.core.score, items)
        return reward_pb2.ScoreResponse(scores=codec.encode(scores))


def add_to_server(core: RewardCore, server: grpc.aio.Server) -> list[str]:
    reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(core), server)
    return [reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name]
