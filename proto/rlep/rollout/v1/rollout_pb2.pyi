from rlep.common.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_FORMAT_UNSPECIFIED: _ClassVar[WeightFormat]
    SAFETENSORS: _ClassVar[WeightFormat]

class DigestAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIGEST_ALGORITHM_UNSPECIFIED: _ClassVar[DigestAlgorithm]
    SHA256: _ClassVar[DigestAlgorithm]
    XXH3_128: _ClassVar[DigestAlgorithm]

class BroadcastBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BROADCAST_BACKEND_UNSPECIFIED: _ClassVar[BroadcastBackend]
    NCCL: _ClassVar[BroadcastBackend]
    GLOO: _ClassVar[BroadcastBackend]
WEIGHT_FORMAT_UNSPECIFIED: WeightFormat
SAFETENSORS: WeightFormat
DIGEST_ALGORITHM_UNSPECIFIED: DigestAlgorithm
SHA256: DigestAlgorithm
XXH3_128: DigestAlgorithm
BROADCAST_BACKEND_UNSPECIFIED: BroadcastBackend
NCCL: BroadcastBackend
GLOO: BroadcastBackend

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenPrompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("chat", "tokens", "text")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    chat: ChatPrompt
    tokens: TokenPrompt
    text: str
    def __init__(self, chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., tokens: _Optional[_Union[TokenPrompt, _Mapping]] = ..., text: _Optional[str] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingOptions
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "policy_version")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _trajectory_pb2.FinishReason
    policy_version: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_trajectory_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt_text", "samples")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions", "policy_version")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    policy_version: int
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class WeightHeader(_message.Message):
    __slots__ = ("version", "sha256", "total_bytes", "format", "digest_algorithm", "digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    sha256: str
    total_bytes: int
    format: WeightFormat
    digest_algorithm: DigestAlgorithm
    digest: str
    def __init__(self, version: _Optional[int] = ..., sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ..., format: _Optional[_Union[WeightFormat, str]] = ..., digest_algorithm: _Optional[_Union[DigestAlgorithm, str]] = ..., digest: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "data", "shared_file", "nccl_broadcast")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_FILE_FIELD_NUMBER: _ClassVar[int]
    NCCL_BROADCAST_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    data: bytes
    shared_file: str
    nccl_broadcast: NcclBroadcast
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., shared_file: _Optional[str] = ..., nccl_broadcast: _Optional[_Union[NcclBroadcast, _Mapping]] = ...) -> None: ...

class NcclBroadcast(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "tensors", "backend", "timeout_s", "bucket_bytes")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    backend: BroadcastBackend
    timeout_s: float
    bucket_bytes: int
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., backend: _Optional[_Union[BroadcastBackend, str]] = ..., timeout_s: _Optional[float] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "receive_seconds", "load_seconds", "receive_peak_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    receive_seconds: float
    load_seconds: float
    receive_peak_bytes: int
    def __init__(self, version: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., receive_peak_bytes: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("policy_version", "model", "requests_in_flight", "max_model_len", "vocab_size", "replica_id", "generated_tokens", "pid", "dtype", "logprobs_mode", "workers")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    model: str
    requests_in_flight: int
    max_model_len: int
    vocab_size: int
    replica_id: str
    generated_tokens: int
    pid: int
    dtype: str
    logprobs_mode: str
    workers: int
    def __init__(self, policy_version: _Optional[int] = ..., model: _Optional[str] = ..., requests_in_flight: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., replica_id: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., pid: _Optional[int] = ..., dtype: _Optional[str] = ..., logprobs_mode: _Optional[str] = ..., workers: _Optional[int] = ...) -> None: ...
