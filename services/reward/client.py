"""Reward clients: in-process and gRPC behind one interface."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Protocol

import torch

from rolefleet.common import codec
from rolefleet.common.errors import RoleFleetError
from rolefleet.common.pb import common_pb2, reward_pb2, reward_pb2_grpc
from rolefleet.common.role_types import RoleStatus
from rolefleet.reward.types import AgentItem, AgentOutcome, EnvItem, EnvOutcome, ScoreItem, ScoreResult
from rolefleet.rpc.roles import GrpcRoleClient, call

if TYPE_CHECKING:  # clients depend on types and stubs only: the coordinator never loads a model library
    from rolefleet.reward.core import RewardCore


class RewardClient(Protocol):
    async def score(self, items: list[ScoreItem]) -> ScoreResult: ...
    async def step(self, items: list[EnvItem]) -> list[EnvOutcome]:
        """The environment's answer to each conversation's last assistant turn (multi-turn rollouts)."""
        ...
    async def run_agents(self, items: list[AgentItem]) -> list[AgentOutcome]:
        """Each episode's agent run to its end (reward.agent): its reward, or why it has none."""
        ...
    async def status(self, include_digest: bool = False) -> RoleStatus: ...
    async def close(self) -> None: ...


class InProcessRewardClient:
    def __init__(self, core: RewardCore):
        self.core = core

    async def score(self, items: list[ScoreItem]) -> ScoreResult:
        return await asyncio.to_thread(self.core.score, items)

    async def step(self, items: list[EnvItem]) -> list[EnvOutcome]:
        return await asyncio.to_thread(self.core.step, items)

    async def run_agents(self, items: list[AgentItem]) -> list[AgentOutcome]:
        return await asyncio.to_thread(self.core.run_agents, items)

    async def status(self, include_digest=False):
        return self.core.status(include_digest)

    async def close(self):
        pass


class GrpcRewardClient(GrpcRoleClient):
    stub_class = reward_pb2_grpc.RewardServiceStub

    async def score(self, items: list[ScoreItem]) -> ScoreResult:
        request = reward_pb2.ScoreRequest(items=[
            reward_pb2.ScoreItem(prompt=i.prompt, response=i.response, ground_truth=i.ground_truth,
                                 extra_json=i.extra_json())
            for i in items
        ])
        response = await call(self.stub.Score(request, timeout=self.timeout_s))
        return from_proto(response, len(items))

    async def step(self, items: list[EnvItem]) -> list[EnvOutcome]:
        request = reward_pb2.EnvStepRequest(items=[
            reward_pb2.EnvStepItem(prompt=i.prompt, ground_truth=i.ground_truth,
                                   extra_json=ScoreItem("", "", "", i.extra).extra_json(),
                                   messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"])
                                             for m in i.messages])
            for i in items
        ])
        response = await call(self.stub.Step(request, timeout=self.timeout_s))
        if len(response.outcomes) != len(items):
            raise RoleFleetError(f"reward server answered {len(response.outcomes)} environment outcomes for "
                                 f"{len(items)} conversations")
        return [outcome_from_proto(o) for o in response.outcomes]


    async def run_agents(self, items: list[AgentItem]) -> list[AgentOutcome]:
        request = reward_pb2.RunAgentsRequest(items=[
            reward_pb2.AgentItem(base_url=i.base_url, key=i.key, prompt_json=json.dumps(i.prompt),
                                 ground_truth=i.ground_truth, extra_json=ScoreItem("", "", "", i.extra).extra_json())
            for i in items])
        # An episode runs up to reward.agent.timeout_s: no shorter deadline than the role's own.
        response = await call(self.stub.RunAgents(request, timeout=None))
        if len(response.outcomes) != len(items):
            raise RoleFleetError(f"reward server answered {len(response.outcomes)} agent outcomes for {len(items)} "
                                 "episodes")
        return [AgentOutcome(o.reward, o.error) for o in response.outcomes]


def outcome_from_proto(o: reward_pb2.EnvStepOutcome) -> EnvOutcome:
    return EnvOutcome(observation=[{"role": m.role, "content": m.content} for m in o.observation], done=o.done,
                      reward=o.reward if o.has_reward else None, tool_calls=o.tool_calls, tool_errors=o.tool_errors,
                      tool_timeouts=o.tool_timeouts, error=o.error)


def from_proto(response: reward_pb2.ScoreResponse, n: int) -> ScoreResult:
    """The result of a ScoreResponse for `n` items; RoleFleetError when it does not describe them."""
    try:
        total = codec.decode_as(response.scores, "scores", torch.float32, 1).float()
        sources = {s.name: codec.decode_as(s.scores, f"sources[{s.name!r}].scores", torch.float32, 1).float()
                   for s in response.sources}
        if len(sources) != len(response.sources):
            raise ValueError("a source name appears twice")
        return ScoreResult(total, sources, list(response.errors)).check(n)
    except (RoleFleetError, ValueError) as e:
        raise RoleFleetError(f"reward server sent a malformed result for {n} items: {e}") from None
