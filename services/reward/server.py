"""The reward role's thin gRPC shell."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc

from rolefleet.common import codec
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.pb import common_pb2, reward_pb2, reward_pb2_grpc
from rolefleet.reward.core import RewardCore
from rolefleet.reward.types import AgentItem, EnvItem, EnvOutcome, ScoreItem, ScoreResult
from rolefleet.rpc.server import RoleServicer, rpc


class RewardServicer(RoleServicer, reward_pb2_grpc.RewardServiceServicer):
    role = "reward"

    def __init__(self, core: RewardCore):
        self.core = core

    @rpc
    async def Score(self, request: reward_pb2.ScoreRequest, context):
        items = [ScoreItem(i.prompt, i.response, i.ground_truth, _extra(n, i.extra_json))
                 for n, i in enumerate(request.items)]
        result = await asyncio.to_thread(self.core.score, items)
        return to_proto(result)


    @rpc
    async def Step(self, request: reward_pb2.EnvStepRequest, context):
        items = [EnvItem(i.prompt, i.ground_truth, [{"role": m.role, "content": m.content} for m in i.messages],
                         _extra(n, i.extra_json)) for n, i in enumerate(request.items)]
        outcomes = await asyncio.to_thread(self.core.step, items)
        return reward_pb2.EnvStepResponse(outcomes=[outcome_to_proto(o) for o in outcomes])


    @rpc
    async def RunAgents(self, request: reward_pb2.RunAgentsRequest, context):
        items = [AgentItem(i.base_url, i.key, _prompt(n, i.prompt_json), i.ground_truth, _extra(n, i.extra_json))
                 for n, i in enumerate(request.items)]
        outcomes = await asyncio.to_thread(self.core.run_agents, items)
        return reward_pb2.RunAgentsResponse(outcomes=[reward_pb2.AgentOutcome(reward=o.reward, error=o.error)
                                                      for o in outcomes])


def _prompt(index: int, text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidArgument(f"items[{index}].prompt_json", "not JSON") from None
    if _depth(value) > MAX_EXTRA_DEPTH:
        raise InvalidArgument(f"items[{index}].prompt_json", f"nested deeper than {MAX_EXTRA_DEPTH} levels")
    return value


def outcome_to_proto(o: EnvOutcome) -> reward_pb2.EnvStepOutcome:
    return reward_pb2.EnvStepOutcome(
        observation=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in o.observation],
        done=o.done, has_reward=o.reward is not None, reward=o.reward or 0.0, tool_calls=o.tool_calls,
        tool_errors=o.tool_errors, tool_timeouts=o.tool_timeouts, error=o.error)


# Dataset columns nest a few levels. Deeper JSON overflows the recursion of the parser, or later of
# pickle on its way to the reward workers, and would fail the request with an internal error.
MAX_EXTRA_DEPTH = 64


def _extra(index: int, text: str) -> dict[str, Any]:
    if not text:
        return {}
    field = f"items[{index}].extra_json"
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidArgument(field, f"nested deeper than {MAX_EXTRA_DEPTH} levels") from None
    except ValueError as e:
        raise InvalidArgument(field, f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"a JSON object is expected, got {type(value).__name__}")
    if _depth(value) > MAX_EXTRA_DEPTH:
        raise InvalidArgument(field, f"nested deeper than {MAX_EXTRA_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (an object or array counts one level), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def to_proto(result: ScoreResult) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(
        scores=codec.encode(result.total),
        sources=[reward_pb2.SourceScores(name=name, scores=codec.encode(scores))
                 for name, scores in result.sources.items()],
        errors=result.errors,
    )


def add_to_server(core: RewardCore, server: grpc.aio.Server) -> list[str]:
    reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(core), server)
    return [reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name]
