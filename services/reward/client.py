"""Reward clients: in-process and gRPC behind one interface."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import torch

from rolefleet.common import codec
from rolefleet.common.errors import RoleFleetError
from rolefleet.common.pb import reward_pb2, reward_pb2_grpc
from rolefleet.common.roles import GrpcRoleClient, RoleStatus, call
from rolefleet.reward.types import ScoreItem

if TYPE_CHECKING:  # clients depend on types and stubs only: the coordinator never loads a model library
    from rolefleet.reward.core import RewardCore


class RewardClient(Protocol):
    async def score(self, items: list[ScoreItem]) -> torch.Tensor: ...
    async def status(self, include_digest: bool = False) -> RoleStatus: ...
    async def close(self) -> None: ...


class InProcessRewardClient:
    def __init__(self, core: RewardCore):
        self.core = core

    async def score(self, items):
        return await asyncio.to_thread(self.core.score, items)

    async def status(self, include_digest=False):
        return self.core.status(include_digest)

    async def close(self):
        pass


class GrpcRewardClient(GrpcRoleClient):
    stub_class = reward_pb2_grpc.RewardServiceStub

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
