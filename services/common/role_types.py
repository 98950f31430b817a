"""The plain results every role answers (status, update, checkpoint), shared by cores, servers and
clients: they import no gRPC code but the messages they convert to and from."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

from rolefleet.common.pb import common_pb2

# Tells this process apart from any other server that answers at the same address (`up` checks it).
INSTANCE_ID = uuid.uuid4().hex
UNSET_DEVICES = "(unset)"  # no CUDA_VISIBLE_DEVICES: every GPU of the machine is visible


@dataclass(frozen=True)
class RoleStatus:
    role: str
    model_version: int = 0
    last_step: int = 0
    weights_digest: str = ""
    requests_served: int = 0
    broken: str = ""  # why the role refuses updates until restarted
    instance_id: str = INSTANCE_ID  # the answering process (a status is built where it is served)
    workers: int = 1
    # The GPUs the answering process was given (`up`, compose and Helm set them per role).
    devices: str = field(default_factory=lambda: os.environ.get("CUDA_VISIBLE_DEVICES", UNSET_DEVICES))
    engine: str = ""  # the actor's rollout engine as it generates now (`RolloutEngine.name`)

    def to_proto(self) -> common_pb2.RoleStatus:
        return common_pb2.RoleStatus(
            role=self.role, model_version=self.model_version, last_step=self.last_step,
            weights_digest=self.weights_digest, requests_served=self.requests_served, broken=self.broken,
            instance_id=self.instance_id, workers=self.workers, devices=self.devices, engine=self.engine,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.RoleStatus) -> RoleStatus:
        return cls(msg.role, msg.model_version, msg.last_step, msg.weights_digest, msg.requests_served,
                   msg.broken, msg.instance_id, msg.workers, msg.devices, msg.engine)


@dataclass(frozen=True)
class UpdateResult:
    """What a trainer role answers to Update (and replays for a repeated step)."""

    step: int
    model_version: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a trainer role answers to SaveCheckpoint and LoadCheckpoint."""

    step: int           # the last applied step of the saved or loaded state
    model_version: int

    def to_proto(self) -> common_pb2.CheckpointResponse:
        return common_pb2.CheckpointResponse(step=self.step, model_version=self.model_version)

    @classmethod
    def from_proto(cls, msg: common_pb2.CheckpointResponse) -> CheckpointInfo:
        return cls(msg.step, msg.model_version)
