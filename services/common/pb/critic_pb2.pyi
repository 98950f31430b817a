from rolefleet.common.pb import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ComputeValuesRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.SequenceBatch
    def __init__(self, batch: _Optional[_Union[_common_pb2.SequenceBatch, _Mapping]] = ...) -> None: ...

class ComputeValuesResponse(_message.Message):
    __slots__ = ("values", "model_version")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    values: _common_pb2.Tensor
    model_version: int
    def __init__(self, values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., model_version: _Optional[int] = ...) -> None: ...

class CriticUpdateRequest(_message.Message):
    __slots__ = ("step", "batch", "returns", "old_values", "values_version")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    VALUES_VERSION_FIELD_NUMBER: _ClassVar[int]
    step: int
    batch: _common_pb2.SequenceBatch
    returns: _common_pb2.Tensor
    old_values: _common_pb2.Tensor
    values_version: int
    def __init__(self, step: _Optional[int] = ..., batch: _Optional[_Union[_common_pb2.SequenceBatch, _Mapping]] = ..., returns: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., old_values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., values_version: _Optional[int] = ...) -> None: ...

class CriticUpdateResponse(_message.Message):
    __slots__ = ("step", "model_version", "stats")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    step: int
    model_version: int
    stats: _common_pb2.TrainStats
    def __init__(self, step: _Optional[int] = ..., model_version: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.TrainStats, _Mapping]] = ...) -> None: ...
