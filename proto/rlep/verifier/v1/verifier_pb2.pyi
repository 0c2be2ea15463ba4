from rlep.common.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyItem(_message.Message):
    __slots__ = ("response", "ground_truth", "data_source", "extra")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    response: str
    ground_truth: str
    data_source: str
    extra: str
    def __init__(self, response: _Optional[str] = ..., ground_truth: _Optional[str] = ..., data_source: _Optional[str] = ..., extra: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("reward", "verdict", "extracted_answer", "seconds", "score")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    EXTRACTED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    reward: float
    verdict: _trajectory_pb2.Verdict
    extracted_answer: str
    seconds: float
    score: float
    def __init__(self, reward: _Optional[float] = ..., verdict: _Optional[_Union[_trajectory_pb2.Verdict, str]] = ..., extracted_answer: _Optional[str] = ..., seconds: _Optional[float] = ..., score: _Optional[float] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...
