"""The teacher role's thin gRPC shell."""

from __future__ import annotations

import asyncio

import grpc

from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.pb import teacher_pb2, teacher_pb2_grpc
from rolefleet.rpc.server import RoleServicer, rpc
from rolefleet.teacher.core import TeacherCore


class TeacherServicer(RoleServicer, teacher_pb2_grpc.TeacherServiceServicer):
    role = "teacher"

    def __init__(self, core: TeacherCore):
        self.core = core

    @rpc
    async def ComputeLogProbs(self, request: teacher_pb2.TeacherLogProbsRequest, context):
        batch = SequenceBatch.from_proto(request.batch, limits=self.core.limits)
        answer = await asyncio.to_thread(self.core.compute_logprobs, batch, request.temperature, request.top_k)
        response = teacher_pb2.TeacherLogProbsResponse(logprobs=codec.encode(answer.logprobs))
        if answer.top is not None:
            ids, logprobs = answer.top.to_proto()
            response.top_ids.CopyFrom(ids)
            response.top_logprobs.CopyFrom(logprobs)
        return response


def add_to_server(core: TeacherCore, server: grpc.aio.Server) -> list[str]:
    teacher_pb2_grpc.add_TeacherServiceServicer_to_server(TeacherServicer(core), server)
    return [teacher_pb2.DESCRIPTOR.services_by_name["TeacherService"].full_name]
