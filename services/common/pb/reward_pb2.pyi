from rolefleet.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentItem(_message.Message):
    __slots__ = ("base_url", "key", "prompt_json", "ground_truth", "extra_json")
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_JSON_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    base_url: str
    key: str
    prompt_json: str
    ground_truth: str
    extra_json: str
    def __init__(self, base_url: _Optional[str] = ..., key: _Optional[str] = ..., prompt_json: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_json: _Optional[str] = ...) -> None: ...

class RunAgentsRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[AgentItem]
    def __init__(self, items: _Optional[_Iterable[_Union[AgentItem, _Mapping]]] = ...) -> None: ...

class AgentOutcome(_message.Message):
    __slots__ = ("reward", "error")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reward: float
    error: str
    def __init__(self, reward: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class RunAgentsResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[AgentOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[AgentOutcome, _Mapping]]] = ...) -> None: ...

class EnvStepItem(_message.Message):
    __slots__ = ("prompt", "ground_truth", "extra_json", "messages")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    ground_truth: str
    extra_json: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, prompt: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_json: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class EnvStepRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EnvStepItem]
    def __init__(self, items: _Optional[_Iterable[_Union[EnvStepItem, _Mapping]]] = ...) -> None: ...

class EnvStepOutcome(_message.Message):
    __slots__ = ("observation", "done", "has_reward", "reward", "tool_calls", "tool_errors", "tool_timeouts", "error")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    HAS_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TOOL_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    observation: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    done: bool
    has_reward: bool
    reward: float
    tool_calls: int
    tool_errors: int
    tool_timeouts: int
    error: str
    def __init__(self, observation: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., done: _Optional[bool] = ..., has_reward: _Optional[bool] = ..., reward: _Optional[float] = ..., tool_calls: _Optional[int] = ..., tool_errors: _Optional[int] = ..., tool_timeouts: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class EnvStepResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[EnvStepOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[EnvStepOutcome, _Mapping]]] = ...) -> None: ...

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
