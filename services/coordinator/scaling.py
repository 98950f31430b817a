"""Reward replicas added to and removed from a running run (HTTP control plane, `rolefleet scale`).

The coordinator scores through a ReplicatedRewardClient even with one replica, so that a replica
can join at any time: it is checked first (it must answer GetStatus as a reward server), then gets
its share of the next batches. A removed replica gets no new work and finishes what it has; a call
it fails meanwhile goes to another replica, so a run loses no sample to scaling.
"""

from __future__ import annotations

import re

from rolefleet.common.errors import RoleFleetError
from rolefleet.coordinator.state import ControlError
from rolefleet.reward.client import GrpcRewardClient
from rolefleet.reward.replicas import ReplicatedRewardClient
from rolefleet.rpc.roles import fetch_status

ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")
CHECK_TIMEOUT_S = 5.0


class RewardScaling:
    def __init__(self, rpc_timeout_s: float):
        self.rpc_timeout_s = rpc_timeout_s
        self.client: ReplicatedRewardClient | None = None  # set once the run has connected to its roles

    def replicas(self) -> list[str]:
        return self.client.active_labels() if self.client else []

    def _running(self) -> ReplicatedRewardClient:
        if self.client is None:
            raise ControlError("the run is not connected to its reward replicas (yet, or any more)")
        return self.client

    async def add(self, address: str) -> list[str]:
        client = self._running()
        if not (match := ADDRESS.match(address)) or not 0 < int(match.group(2)) < 65536:
            raise ValueError(f"address: {address!r} is not HOST:PORT")
        if address in client.active_labels():
            raise ControlError(f"reward replica {address} is already in use")
        try:
            status = await fetch_status("reward", address, CHECK_TIMEOUT_S)
        except RoleFleetError as exc:
            raise ControlError(f"reward replica {address} does not answer: {exc}") from None
        if status.role != "reward":
            raise ControlError(f"{address} is a {status.role} server, not a reward one")
        client.add(GrpcRewardClient(address, self.rpc_timeout_s), address)
        return client.active_labels()

    def remove(self, address: str) -> list[str]:
        client = self._running()
        try:
            client.retire(address)
        except KeyError as exc:
            raise ControlError(str(exc.args[0])) from None
        except ValueError as exc:
            raise ControlError(str(exc)) from None
        return client.active_labels()
