"""Reward clients: in-process and gRPC behind one interface."""

from __future__ import annotations

import asyncio
from typing import Protocol

import torch

from rolefleet.common import codec
from rolefleet.common.errors import RoleFleetError
from rolefleet.common.pb import common_pb2, reward_pb2, reward_pb2_grpc
from rolefleet.common.roles import RoleStatus, call, open_channel
from rolefleet.reward.core import RewardCore, ScoreItem


class RewardClient(Protocol):
    async def score(self, items: list[ScoreItem]) -> torch.Tensor: ...
    async def status(self) -> RoleStatus: ...
    async def close(self) -> None: ...


class InProcessRewardClient:
    def __init__(self, core: RewardCore):
        self.core = core

    async def score(self, items):
        return await asyncio.to_thread(self.core.score, items)

    async def status(self):
        return RoleStatus("reward")

    async def close(self):
        pass


class GrpcRewardClient:
    def __init__(self, address: str, timeout_s: float):
        self.channel = open_channel(address)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.timeout_s = timeout_s

    async def score(self, items):
        request = reward_pb2.ScoreRequest(
            items=[reward_pb2.ScoreItem(prompt=i.prompt, response=i.response, ground_truth=i.ground_truth)
                   for i in items]
        )
        response = await call(self.stub.Score(request, timeout=self.timeout_s))
        scores = codec.decode_as(response.scores, "scores", torch.float32, 1)
        if scores.numel() != len(items):
            raise RoleFleetError(f"reward server returned {scores.numel()} scores for {len(items)} items")
        return scores

    async def status(self):
        msg = await call(self.stub.GetStatus(common_pb2.GetStatusRequest(), timeout=self.timeout_s))
        return RoleStatus.from_proto(msg)

    async def close(self):
        await self.channel.close()
