"""Teacher clients: in-process and gRPC behind one interface."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.pb import teacher_pb2, teacher_pb2_grpc
from rolefleet.common.role_types import RoleStatus
from rolefleet.common.top_k import TopK
from rolefleet.rpc.roles import GrpcRoleClient, call
from rolefleet.teacher.types import TeacherLogProbs

if TYPE_CHECKING:  # clients depend on types and stubs only: the coordinator never loads a model library
    from rolefleet.teacher.core import TeacherCore


class TeacherClient(Protocol):
    async def compute_logprobs(self, batch: SequenceBatch, temperature: float, top_k: int = 0) -> TeacherLogProbs: ...
    async def status(self, include_digest: bool = False) -> RoleStatus: ...
    async def close(self) -> None: ...


class InProcessTeacherClient:
    def __init__(self, core: TeacherCore):
        self.core = core

    async def compute_logprobs(self, batch, temperature, top_k=0):
        return await asyncio.to_thread(self.core.compute_logprobs, batch, temperature, top_k)

    async def status(self, include_digest=False):
        return await asyncio.to_thread(self.core.status, include_digest)

    async def close(self):
        pass


class GrpcTeacherClient(GrpcRoleClient):
    stub_class = teacher_pb2_grpc.TeacherServiceStub

    async def compute_logprobs(self, batch, temperature, top_k=0):
        request = teacher_pb2.TeacherLogProbsRequest(batch=batch.to_proto(), temperature=temperature, top_k=top_k)
        response = await call(self.stub.ComputeLogProbs(request, timeout=self.timeout_s))
        top = None
        if top_k:
            top = TopK.from_proto(response.top_ids, response.top_logprobs, batch, ("top_ids", "top_logprobs"))
            if top.k != top_k:
                raise ValueError(f"the teacher answered {top.k} tokens a position for top_k {top_k}")
        return TeacherLogProbs(batch.per_token(response.logprobs, "logprobs"), top)
