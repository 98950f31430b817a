from rolefleet.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("prompt", "response", "ground_truth", "extra_json")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    response: str
    ground_truth: str
    extra_json: str
    def __init__(self, prompt: _Optional[str] = ..., response: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class SourceScores(_message.Message):
    __slots__ = ("name", "scores")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    name: str
    scores: _common_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., scores: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "sources", "errors")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    scores: _common_pb2.Tensor
    sources: _containers.RepeatedCompositeFieldContainer[SourceScores]
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, scores: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[SourceScores, _Mapping]]] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...
