"""The critic role's thin gRPC shell."""

from __future__ import annotations

import asyncio

import grpc

from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.pb import common_pb2, critic_pb2, critic_pb2_grpc
from rolefleet.critic.core import CriticCore
from rolefleet.rpc.server import TrainerServicer, rpc


class CriticServicer(TrainerServicer, critic_pb2_grpc.CriticServiceServicer):
    role = "critic"

    def __init__(self, core: CriticCore):
        self.core = core

    @rpc
    async def ComputeValues(self, request: critic_pb2.ComputeValuesRequest, context):
        batch = SequenceBatch.from_proto(request.batch, limits=self.core.limits)
        values, version = await asyncio.to_thread(self.core.versioned_values, batch)
        return critic_pb2.ComputeValuesResponse(values=codec.encode(values), model_version=version)

    @rpc
    async def Update(self, request: critic_pb2.CriticUpdateRequest, context):
        batch = SequenceBatch.from_proto(request.batch, limits=self.core.limits)
        returns = batch.per_token(request.returns, "returns")
        old_values = batch.per_token(request.old_values, "old_values")
        fence = request.values_version if request.HasField("values_version") else None
        result = await asyncio.to_thread(self.core.update, request.step, batch, returns, old_values, fence)
        return critic_pb2.CriticUpdateResponse(step=result.step, model_version=result.model_version,
                                               stats=common_pb2.TrainStats(values=result.stats))


def add_to_server(core: CriticCore, server: grpc.aio.Server) -> list[str]:
    critic_pb2_grpc.add_CriticServiceServicer_to_server(CriticServicer(core), server)
    return [critic_pb2.DESCRIPTOR.services_by_name["CriticService"].full_name]
