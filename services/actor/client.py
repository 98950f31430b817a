"""Actor clients: one interface, an in-process implementation (tests, single-process runs) and a
gRPC one (real deployments). The coordinator cannot tell them apart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import grpc

from rolefleet.actor import wire
from rolefleet.actor.types import (
    ActorUpdateResult,
    AgentTask,
    Continuation,
    LogProbs,
    PolicyTargets,
    Sample,
    SamplingParams,
    Trajectory,
)
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.errors import error_from_rpc
from rolefleet.common.pb import actor_pb2, actor_pb2_grpc
from rolefleet.common.role_types import CheckpointInfo, RoleStatus
from rolefleet.rpc.roles import GrpcTrainerClient, InProcessTrainerClient, call
from rolefleet.rpc.streams import iterate_in_thread

if TYPE_CHECKING:  # clients depend on types and stubs only: the coordinator never loads a model library
    from rolefleet.actor.core import ActorCore


class ActorClient(Protocol):
    async def generate(self, prompts: list[str], sampling: SamplingParams, first_group_id: int = 0,
                       continuations: list[Continuation] | None = None) -> list[Sample]:
        """n samples per prompt; or, given `continuations` (and no prompts), one more turn of each
        conversation (multi-turn rollouts)."""
        ...
    def generate_stream(self, prompts: list[str], sampling: SamplingParams,
                        first_group_id: int = 0) -> AsyncIterator[list[Sample]]:
        """The samples of `generate`, in the same order, as they finish (a list per arrival)."""
        ...
    async def compute_logprobs(self, batch: SequenceBatch, temperature: float, include_reference: bool,
                               reference_only: bool = False) -> LogProbs: ...
    async def update(self, step: int, policy_version: int, batch: SequenceBatch, targets: PolicyTargets,
                     temperature: float) -> ActorUpdateResult: ...
    async def status(self, include_digest: bool = False) -> RoleStatus: ...
    async def open_sessions(self, ids: list[str], sampling: SamplingParams,
                            tasks: list[AgentTask] | None = None) -> list[str]:
        """Sessions of the OpenAI-compatible endpoint, one per agent-driven episode; their keys.
        `tasks`: for agents outside the cluster to claim."""
        ...
    async def session_rewards(self, ids: list[str]) -> list[float | None]:
        """The rewards agents outside the cluster posted for the sessions (None: not yet)."""
        ...
    async def close_sessions(self, ids: list[str]) -> list[Trajectory]:
        """The sessions' trajectories, in order; the sessions are gone afterwards."""
        ...
    async def save_checkpoint(self, step: int, path: str, background: bool = False) -> CheckpointInfo: ...
    async def load_checkpoint(self, path: str) -> CheckpointInfo: ...
    async def close(self) -> None: ...


class InProcessActorClient(InProcessTrainerClient):
    core: ActorCore

    async def generate(self, prompts, sampling, first_group_id=0, continuations=None):
        return await asyncio.to_thread(self.core.generate, prompts, sampling, first_group_id, continuations)

    async def generate_stream(self, prompts, sampling, first_group_id=0):
        async for chunk in iterate_in_thread(lambda: self.core.generate_chunks(prompts, sampling, first_group_id)):
            yield chunk

    async def compute_logprobs(self, batch, temperature, include_reference, reference_only=False):
        return await asyncio.to_thread(self.core.compute_logprobs, batch, temperature, include_reference,
                                       reference_only)

    async def update(self, step, policy_version, batch, targets, temperature):
        return await asyncio.to_thread(self.core.update, step, policy_version, batch, targets, temperature)

    async def open_sessions(self, ids, sampling, tasks=None):
        return self.core.open_sessions(ids, sampling, tasks)

    async def session_rewards(self, ids):
        return self.core.session_rewards(ids)

    async def close_sessions(self, ids):
        return self.core.close_sessions(ids)



class GrpcActorClient(GrpcTrainerClient):
    stub_class = actor_pb2_grpc.ActorServiceStub

    async def generate(self, prompts, sampling, first_group_id=0, continuations=None):
        return [sample async for chunk in self.generate_stream(prompts, sampling, first_group_id, continuations)
                for sample in chunk]

    async def generate_stream(self, prompts, sampling, first_group_id=0, continuations=None):
        request = actor_pb2.GenerateRequest(prompts=prompts, sampling=wire.sampling_to_proto(sampling),
                                            first_group_id=first_group_id,
                                            continuations=[wire.continuation_to_proto(c) for c in continuations or []])
        try:
            async for message in self.stub.Generate(request, timeout=self.timeout_s):
                yield [wire.sample_from_proto(message)]
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None

    async def compute_logprobs(self, batch, temperature, include_reference, reference_only=False):
        request = actor_pb2.ComputeLogProbsRequest(batch=batch.to_proto(), temperature=temperature,
                                                   include_reference=include_reference, reference_only=reference_only)
        return wire.logprobs_from_proto(await call(self.stub.ComputeLogProbs(request, timeout=self.timeout_s)))

    async def update(self, step, policy_version, batch, targets, temperature):
        request = actor_pb2.ActorUpdateRequest(step=step, policy_version=policy_version, batch=batch.to_proto(),
                                               temperature=temperature, **wire.policy_targets_to_proto(targets))
        return wire.update_result_from_proto(await call(self.stub.Update(request, timeout=self.timeout_s)))

    async def open_sessions(self, ids, sampling, tasks=None):
        request = actor_pb2.OpenSessionsRequest(session_ids=ids, sampling=wire.sampling_to_proto(sampling),
                                                tasks=[wire.task_to_proto(t) for t in tasks or []])
        return list((await call(self.stub.OpenSessions(request, timeout=self.timeout_s))).keys)

    async def session_rewards(self, ids):
        response = await call(self.stub.SessionRewards(actor_pb2.SessionRewardsRequest(session_ids=ids),
                                                       timeout=self.timeout_s))
        return [r.reward if r.posted else None for r in response.rewards]

    async def close_sessions(self, ids):
        response = await call(self.stub.CloseSessions(actor_pb2.CloseSessionsRequest(session_ids=ids),
                                                      timeout=self.timeout_s))
        return [wire.trajectory_from_proto(t) for t in response.trajectories]

