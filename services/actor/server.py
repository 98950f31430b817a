"""The actor's thin gRPC shell: proto -> domain, one core call (off the event loop), domain -> proto."""

from __future__ import annotations

import asyncio

import grpc

from rolefleet.actor import wire
from rolefleet.actor.core import ActorCore
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.errors import InvalidArgument, LimitExceeded
from rolefleet.common.pb import actor_pb2, actor_pb2_grpc
from rolefleet.rpc.server import TrainerServicer, rpc, rpc_stream
from rolefleet.rpc.streams import iterate_in_thread


class ActorServicer(TrainerServicer, actor_pb2_grpc.ActorServiceServicer):
    role = "actor"

    def __init__(self, core: ActorCore):
        self.core = core

    @rpc_stream
    async def Generate(self, request: actor_pb2.GenerateRequest, context):
        if not request.HasField("sampling"):  # all zeros would read as greedy with top_p 0
            raise InvalidArgument("sampling", "required")
        sampling = wire.sampling_from_proto(request.sampling)
        prompts = list(request.prompts)
        if len(request.continuations) > self.core.cfg.max_sequences_per_request:  # before decoding them
            raise LimitExceeded("continuations", f"{len(request.continuations)} exceed "
                                f"actor.max_sequences_per_request={self.core.cfg.max_sequences_per_request}")
        continuations = wire.continuations_from_proto(request.continuations)
        # Validation, tokenization and generation all run off the loop; each forward batch is sent
        # as soon as it finishes.
        async for chunk in iterate_in_thread(lambda: self.core.generate_chunks(prompts, sampling,
                                                                               request.first_group_id, continuations)):
            for sample in chunk:
                yield wire.sample_to_proto(sample)

    @rpc
    async def ComputeLogProbs(self, request: actor_pb2.ComputeLogProbsRequest, context):
        batch = SequenceBatch.from_proto(request.batch, limits=self.core.limits)
        result = await asyncio.to_thread(
            self.core.compute_logprobs, batch, request.temperature, request.include_reference, request.reference_only
        )
        return wire.logprobs_to_proto(result)

    @rpc
    async def Update(self, request: actor_pb2.ActorUpdateRequest, context):
        batch = SequenceBatch.from_proto(request.batch, limits=self.core.limits)
        targets = wire.policy_targets_from_proto(request, batch)
        result = await asyncio.to_thread(
            self.core.update, request.step, request.policy_version, batch, targets, request.temperature
        )
        return wire.update_result_to_proto(result)


    @rpc
    async def OpenSessions(self, request: actor_pb2.OpenSessionsRequest, context):
        if not request.HasField("sampling"):
            raise InvalidArgument("sampling", "required")
        keys = self.core.open_sessions(list(request.session_ids), wire.sampling_from_proto(request.sampling),
                                       wire.tasks_from_proto(request.tasks))
        return actor_pb2.OpenSessionsResponse(keys=keys)

    @rpc
    async def SessionRewards(self, request: actor_pb2.SessionRewardsRequest, context):
        rewards = self.core.session_rewards(list(request.session_ids))
        return actor_pb2.SessionRewardsResponse(rewards=[
            actor_pb2.SessionReward(posted=r is not None, reward=r or 0.0) for r in rewards])

    @rpc
    async def CloseSessions(self, request: actor_pb2.CloseSessionsRequest, context):
        trajectories = self.core.close_sessions(list(request.session_ids))
        return actor_pb2.CloseSessionsResponse(trajectories=[wire.trajectory_to_proto(t) for t in trajectories])


def add_to_server(core: ActorCore, server: grpc.aio.Server) -> list[str]:
    actor_pb2_grpc.add_ActorServiceServicer_to_server(ActorServicer(core), server)
    return [actor_pb2.DESCRIPTOR.services_by_name["ActorService"].full_name]
