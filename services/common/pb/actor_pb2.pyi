from rolefleet.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class AgentTask(_message.Message):
    __slots__ = ("prompt_json", "ground_truth", "extra_json")
    PROMPT_JSON_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt_json: str
    ground_truth: str
    extra_json: str
    def __init__(self, prompt_json: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_json: _Optional[str] = ...) -> None: ...

class OpenSessionsRequest(_message.Message):
    __slots__ = ("session_ids", "sampling", "tasks")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    sampling: SamplingParams
    tasks: _containers.RepeatedCompositeFieldContainer[AgentTask]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[AgentTask, _Mapping]]] = ...) -> None: ...

class SessionRewardsRequest(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionReward(_message.Message):
    __slots__ = ("posted", "reward")
    POSTED_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    posted: bool
    reward: float
    def __init__(self, posted: _Optional[bool] = ..., reward: _Optional[float] = ...) -> None: ...

class SessionRewardsResponse(_message.Message):
    __slots__ = ("rewards",)
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.RepeatedCompositeFieldContainer[SessionReward]
    def __init__(self, rewards: _Optional[_Iterable[_Union[SessionReward, _Mapping]]] = ...) -> None: ...

class OpenSessionsResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseSessionsRequest(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "response_ids", "logprobs", "versions", "own", "finish_reason", "turns", "last_text", "error", "tool_calls")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    LAST_TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _common_pb2.Tensor
    response_ids: _common_pb2.Tensor
    logprobs: _common_pb2.Tensor
    versions: _common_pb2.Tensor
    own: _common_pb2.Tensor
    finish_reason: FinishReason
    turns: int
    last_text: str
    error: str
    tool_calls: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., response_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., versions: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., own: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., turns: _Optional[int] = ..., last_text: _Optional[str] = ..., error: _Optional[str] = ..., tool_calls: _Optional[int] = ...) -> None: ...

class CloseSessionsResponse(_message.Message):
    __slots__ = ("trajectories",)
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "n", "seed", "stop_token_ids", "stop_at_end_of_turn")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_END_OF_TURN_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    n: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_at_end_of_turn: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_at_end_of_turn: _Optional[bool] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("context_ids", "observation", "resume_from")
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    context_ids: _common_pb2.Tensor
    observation: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    resume_from: int
    def __init__(self, context_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., observation: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., resume_from: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "first_group_id", "continuations")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedScalarFieldContainer[str]
    sampling: SamplingParams
    first_group_id: int
    continuations: _containers.RepeatedCompositeFieldContainer[Continuation]
    def __init__(self, prompts: _Optional[_Iterable[str]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., first_group_id: _Optional[int] = ..., continuations: _Optional[_Iterable[_Union[Continuation, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("prompt_index", "sample_index", "prompt_ids", "response_ids", "logprobs", "finish_reason", "policy_version", "response_text", "group_id", "sample_id")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    sample_index: int
    prompt_ids: _common_pb2.Tensor
    response_ids: _common_pb2.Tensor
    logprobs: _common_pb2.Tensor
    finish_reason: FinishReason
    policy_version: int
    response_text: str
    group_id: int
    sample_id: int
    def __init__(self, prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., prompt_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., response_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version: _Optional[int] = ..., response_text: _Optional[str] = ..., group_id: _Optional[int] = ..., sample_id: _Optional[int] = ...) -> None: ...

class ComputeLogProbsRequest(_message.Message):
    __slots__ = ("batch", "include_reference", "temperature", "reference_only")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ONLY_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.SequenceBatch
    include_reference: bool
    temperature: float
    reference_only: bool
    def __init__(self, batch: _Optional[_Union[_common_pb2.SequenceBatch, _Mapping]] = ..., include_reference: _Optional[bool] = ..., temperature: _Optional[float] = ..., reference_only: _Optional[bool] = ...) -> None: ...

class ComputeLogProbsResponse(_message.Message):
    __slots__ = ("logprobs", "ref_logprobs", "entropy", "policy_version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.Tensor
    ref_logprobs: _common_pb2.Tensor
    entropy: _common_pb2.Tensor
    policy_version: int
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., ref_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., entropy: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ActorUpdateRequest(_message.Message):
    __slots__ = ("step", "policy_version", "batch", "advantages", "old_logprobs", "temperature", "ref_logprobs", "rollout_logprobs", "teacher_top_ids", "teacher_top_logprobs")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    batch: _common_pb2.SequenceBatch
    advantages: _common_pb2.Tensor
    old_logprobs: _common_pb2.Tensor
    temperature: float
    ref_logprobs: _common_pb2.Tensor
    rollout_logprobs: _common_pb2.Tensor
    teacher_top_ids: _common_pb2.Tensor
    teacher_top_logprobs: _common_pb2.Tensor
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., batch: _Optional[_Union[_common_pb2.SequenceBatch, _Mapping]] = ..., advantages: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., old_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., temperature: _Optional[float] = ..., ref_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., rollout_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., teacher_top_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., teacher_top_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ActorUpdateResponse(_message.Message):
    __slots__ = ("step", "policy_version", "stats", "logprobs", "entropy")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    stats: _common_pb2.TrainStats
    logprobs: _common_pb2.Tensor
    entropy: _common_pb2.Tensor
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.TrainStats, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., entropy: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
