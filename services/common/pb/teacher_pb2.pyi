from rolefleet.common.pb import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TeacherLogProbsRequest(_message.Message):
    __slots__ = ("batch", "temperature")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.SequenceBatch
    temperature: float
    def __init__(self, batch: _Optional[_Union[_common_pb2.SequenceBatch, _Mapping]] = ..., temperature: _Optional[float] = ...) -> None: ...

class TeacherLogProbsResponse(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.Tensor
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
