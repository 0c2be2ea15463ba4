from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    CORRECT: _ClassVar[Verdict]
    WRONG: _ClassVar[Verdict]
    UNPARSEABLE: _ClassVar[Verdict]
    TIMEOUT: _ClassVar[Verdict]
    GOLD_UNPARSEABLE: _ClassVar[Verdict]
    ERROR: _ClassVar[Verdict]

class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_UNSPECIFIED: _ClassVar[Source]
    FRESH: _ClassVar[Source]
    REPLAY: _ClassVar[Source]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    ABORT: _ClassVar[FinishReason]
VERDICT_UNSPECIFIED: Verdict
CORRECT: Verdict
WRONG: Verdict
UNPARSEABLE: Verdict
TIMEOUT: Verdict
GOLD_UNPARSEABLE: Verdict
ERROR: Verdict
SOURCE_UNSPECIFIED: Source
FRESH: Source
REPLAY: Source
FINISH_REASON_UNSPECIFIED: FinishReason
STOP: FinishReason
LENGTH: FinishReason
ABORT: FinishReason

class Trajectory(_message.Message):
    __slots__ = ("question_id", "prompt_token_ids", "response_token_ids", "response_text", "reward", "verdict", "source", "policy_version", "finish_reason", "behavior_logprobs", "run_id", "prompt_text", "created_at_ms", "tokenizer_fingerprint", "response_mask", "chat_template_hash", "tool_env_hash", "tool_calls")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOOL_ENV_HASH_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_text: str
    reward: float
    verdict: Verdict
    source: Source
    policy_version: int
    finish_reason: FinishReason
    behavior_logprobs: _containers.RepeatedScalarFieldContainer[float]
    run_id: str
    prompt_text: str
    created_at_ms: int
    tokenizer_fingerprint: str
    response_mask: _containers.RepeatedScalarFieldContainer[int]
    chat_template_hash: str
    tool_env_hash: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, question_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., response_text: _Optional[str] = ..., reward: _Optional[float] = ..., verdict: _Optional[_Union[Verdict, str]] = ..., source: _Optional[_Union[Source, str]] = ..., policy_version: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., behavior_logprobs: _Optional[_Iterable[float]] = ..., run_id: _Optional[str] = ..., prompt_text: _Optional[str] = ..., created_at_ms: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., response_mask: _Optional[_Iterable[int]] = ..., chat_template_hash: _Optional[str] = ..., tool_env_hash: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("code", "status", "exit_code", "stdout", "stderr", "duration_s", "truncated")
    CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    code: str
    status: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    truncated: bool
    def __init__(self, code: _Optional[str] = ..., status: _Optional[str] = ..., exit_code: _Optional[int] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., duration_s: _Optional[float] = ..., truncated: _Optional[bool] = ...) -> None: ...
