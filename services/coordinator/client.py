"""Client of the coordinator's control service (used by `rolefleet status`)."""

from __future__ import annotations

from rolefleet.common.pb import coordinator_pb2, coordinator_pb2_grpc
from rolefleet.rpc.roles import call, open_channel


async def run_status(address: str, timeout_s: float = 5.0) -> coordinator_pb2.RunStatus:
    async with open_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        return await call(stub.GetRunStatus(coordinator_pb2.GetRunStatusRequest(), timeout=timeout_s))


async def stop_run(address: str, timeout_s: float = 5.0) -> coordinator_pb2.StopResponse:
    async with open_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        return await call(stub.Stop(coordinator_pb2.StopRequest(), timeout=timeout_s))
