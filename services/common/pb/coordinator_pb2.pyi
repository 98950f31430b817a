from rolefleet.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_STARTING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_STOPPING: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_PAUSED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_STARTING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_STOPPING: RunState
RUN_STATE_FINISHED: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_PAUSED: RunState

class GetRunStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_name", "state", "step", "total_steps", "policy_version", "last_reward_mean", "error", "roles")
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    run_name: str
    state: RunState
    step: int
    total_steps: int
    policy_version: int
    last_reward_mean: float
    error: str
    roles: _containers.RepeatedCompositeFieldContainer[RoleView]
    def __init__(self, run_name: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., last_reward_mean: _Optional[float] = ..., error: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[RoleView, _Mapping]]] = ...) -> None: ...

class RoleView(_message.Message):
    __slots__ = ("address", "status", "error")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    address: str
    status: _common_pb2.RoleStatus
    error: str
    def __init__(self, address: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.RoleStatus, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...
