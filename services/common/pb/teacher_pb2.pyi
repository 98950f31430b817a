from rolefleet.common.pb import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TeacherLogProbsRequest(_message.Message):
    __slots__ = ("batch", "temperature", "top_k")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.SequenceBatch
    temperature: float
    top_k: int
    def __init__(self, batch: _Optional[_Union[_common_pb2.SequenceBatch, _Mapping]] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class TeacherLogProbsResponse(_message.Message):
    __slots__ = ("logprobs", "top_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.Tensor
    top_ids: _common_pb2.Tensor
    top_logprobs: _common_pb2.Tensor
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
