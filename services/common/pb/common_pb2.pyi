from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SequenceBatch(_message.Message):
    __slots__ = ("prompt_ids", "prompt_lengths", "response_ids", "response_lengths", "loss_mask")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: Tensor
    prompt_lengths: Tensor
    response_ids: Tensor
    response_lengths: Tensor
    loss_mask: Tensor
    def __init__(self, prompt_ids: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_lengths: _Optional[_Union[Tensor, _Mapping]] = ..., response_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_lengths: _Optional[_Union[Tensor, _Mapping]] = ..., loss_mask: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class RoleStatus(_message.Message):
    __slots__ = ("role", "model_version", "last_step", "weights_digest", "requests_served", "broken", "instance_id", "devices", "workers", "engine")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    BROKEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    role: str
    model_version: int
    last_step: int
    weights_digest: str
    requests_served: int
    broken: str
    instance_id: str
    devices: str
    workers: int
    engine: str
    def __init__(self, role: _Optional[str] = ..., model_version: _Optional[int] = ..., last_step: _Optional[int] = ..., weights_digest: _Optional[str] = ..., requests_served: _Optional[int] = ..., broken: _Optional[str] = ..., instance_id: _Optional[str] = ..., devices: _Optional[str] = ..., workers: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("include_weights_digest",)
    INCLUDE_WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    include_weights_digest: bool
    def __init__(self, include_weights_digest: _Optional[bool] = ...) -> None: ...

class TrainStats(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("step", "path", "background")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    background: bool
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., background: _Optional[bool] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("step", "model_version")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    step: int
    model_version: int
    def __init__(self, step: _Optional[int] = ..., model_version: _Optional[int] = ...) -> None: ...
