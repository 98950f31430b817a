"""Critic clients: in-process and gRPC behind one interface."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import torch

from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.pb import critic_pb2, critic_pb2_grpc
from rolefleet.common.role_types import CheckpointInfo, RoleStatus, UpdateResult
from rolefleet.critic.types import CriticValues
from rolefleet.rpc.roles import GrpcTrainerClient, InProcessTrainerClient, call

if TYPE_CHECKING:  # clients depend on types and stubs only: the coordinator never loads a model library
    from rolefleet.critic.core import CriticCore


class CriticClient(Protocol):
    async def compute_values(self, batch: SequenceBatch) -> CriticValues: ...
    async def update(self, step: int, batch: SequenceBatch, returns: torch.Tensor, old_values: torch.Tensor,
                     values_version: int | None = None) -> UpdateResult: ...
    async def status(self, include_digest: bool = False) -> RoleStatus: ...
    async def save_checkpoint(self, step: int, path: str, background: bool = False) -> CheckpointInfo: ...
    async def load_checkpoint(self, path: str) -> CheckpointInfo: ...
    async def close(self) -> None: ...


class InProcessCriticClient(InProcessTrainerClient):
    core: CriticCore

    async def compute_values(self, batch):
        return CriticValues(*await asyncio.to_thread(self.core.versioned_values, batch))

    async def update(self, step, batch, returns, old_values, values_version=None):
        return await asyncio.to_thread(self.core.update, step, batch, returns, old_values, values_version)



class GrpcCriticClient(GrpcTrainerClient):
    stub_class = critic_pb2_grpc.CriticServiceStub

    async def compute_values(self, batch):
        request = critic_pb2.ComputeValuesRequest(batch=batch.to_proto())
        response = await call(self.stub.ComputeValues(request, timeout=self.timeout_s))
        return CriticValues(batch.per_token(response.values, "values"), response.model_version)

    async def update(self, step, batch, returns, old_values, values_version=None):
        request = critic_pb2.CriticUpdateRequest(step=step, batch=batch.to_proto(), returns=codec.encode(returns),
                                                 old_values=codec.encode(old_values), values_version=values_version)
        response = await call(self.stub.Update(request, timeout=self.timeout_s))
        return UpdateResult(response.step, response.model_version, dict(response.stats.values))
