from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("environment_json",)
    ENVIRONMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    environment_json: str
    def __init__(self, environment_json: _Optional[str] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("code", "caller")
    CODE_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    code: str
    caller: str
    def __init__(self, code: _Optional[str] = ..., caller: _Optional[str] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("status", "exit_code", "signal", "stdout", "stderr", "truncated", "duration_s", "isolation", "detail", "cached")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    status: str
    exit_code: int
    signal: int
    stdout: str
    stderr: str
    truncated: bool
    duration_s: float
    isolation: str
    detail: str
    cached: bool
    def __init__(self, status: _Optional[str] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., truncated: _Optional[bool] = ..., duration_s: _Optional[float] = ..., isolation: _Optional[str] = ..., detail: _Optional[str] = ..., cached: _Optional[bool] = ...) -> None: ...
