from rlep.common.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Strategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRATEGY_UNSPECIFIED: _ClassVar[Strategy]
    UNIFORM: _ClassVar[Strategy]
    RECENCY: _ClassVar[Strategy]
    PRIORITIZED: _ClassVar[Strategy]
    DIVERSE: _ClassVar[Strategy]

class QuestionFilter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUESTION_FILTER_UNSPECIFIED: _ClassVar[QuestionFilter]
    PASS_RATE_BAND: _ClassVar[QuestionFilter]
    NEVER_SOLVED: _ClassVar[QuestionFilter]
    MASTERED: _ClassVar[QuestionFilter]
STRATEGY_UNSPECIFIED: Strategy
UNIFORM: Strategy
RECENCY: Strategy
PRIORITIZED: Strategy
DIVERSE: Strategy
QUESTION_FILTER_UNSPECIFIED: QuestionFilter
PASS_RATE_BAND: QuestionFilter
NEVER_SOLVED: QuestionFilter
MASTERED: QuestionFilter

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Question(_message.Message):
    __slots__ = ("question_id", "prompt", "ground_truth", "data_source", "index")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    prompt: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    ground_truth: str
    data_source: str
    index: int
    def __init__(self, question_id: _Optional[str] = ..., prompt: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., ground_truth: _Optional[str] = ..., data_source: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AddTrajectoriesRequest(_message.Message):
    __slots__ = ("pool", "trajectories", "questions")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    questions: _containers.RepeatedCompositeFieldContainer[Question]
    def __init__(self, pool: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ..., questions: _Optional[_Iterable[_Union[Question, _Mapping]]] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("index", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: str
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AddTrajectoriesResponse(_message.Message):
    __slots__ = ("added", "duplicate", "rejected", "rejections", "evicted", "histories_imported", "histories_kept")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    HISTORIES_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    HISTORIES_KEPT_FIELD_NUMBER: _ClassVar[int]
    added: int
    duplicate: int
    rejected: int
    rejections: _containers.RepeatedCompositeFieldContainer[Rejection]
    evicted: int
    histories_imported: int
    histories_kept: int
    def __init__(self, added: _Optional[int] = ..., duplicate: _Optional[int] = ..., rejected: _Optional[int] = ..., rejections: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ..., evicted: _Optional[int] = ..., histories_imported: _Optional[int] = ..., histories_kept: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("pool", "question_ids", "m", "strategy", "seed", "min_policy_version", "trajectories_as_bytes")
    POOL_FIELD_NUMBER: _ClassVar[int]
    QUESTION_IDS_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_AS_BYTES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    question_ids: _containers.RepeatedScalarFieldContainer[str]
    m: int
    strategy: Strategy
    seed: int
    min_policy_version: int
    trajectories_as_bytes: bool
    def __init__(self, pool: _Optional[str] = ..., question_ids: _Optional[_Iterable[str]] = ..., m: _Optional[int] = ..., strategy: _Optional[_Union[Strategy, str]] = ..., seed: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., trajectories_as_bytes: _Optional[bool] = ...) -> None: ...

class QuestionSample(_message.Message):
    __slots__ = ("question_id", "trajectories", "available", "trajectory_bytes")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    available: int
    trajectory_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, question_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ..., available: _Optional[int] = ..., trajectory_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("samples", "short_questions")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SHORT_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[QuestionSample]
    short_questions: int
    def __init__(self, samples: _Optional[_Iterable[_Union[QuestionSample, _Mapping]]] = ..., short_questions: _Optional[int] = ...) -> None: ...

class PriorityUpdate(_message.Message):
    __slots__ = ("question_id", "trajectory_id", "priority")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    trajectory_id: str
    priority: float
    def __init__(self, question_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., priority: _Optional[float] = ...) -> None: ...

class UpdatePrioritiesRequest(_message.Message):
    __slots__ = ("pool", "updates")
    POOL_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    updates: _containers.RepeatedCompositeFieldContainer[PriorityUpdate]
    def __init__(self, pool: _Optional[str] = ..., updates: _Optional[_Iterable[_Union[PriorityUpdate, _Mapping]]] = ...) -> None: ...

class UpdatePrioritiesResponse(_message.Message):
    __slots__ = ("updated", "missing")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    updated: int
    missing: int
    def __init__(self, updated: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...

class GetPoolStatsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class CountBucket(_message.Message):
    __slots__ = ("label", "count")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    label: str
    count: int
    def __init__(self, label: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool", "questions", "trajectories", "successes_per_question", "mean_response_tokens", "std_response_tokens", "response_token_histogram", "per_policy_version", "payload_bytes", "redis_used_memory_bytes", "capacity_per_question", "eviction", "questions_with_history", "pass_rate_histogram", "rescues", "mastered_questions", "never_solved_questions", "history_reports", "replayed_rows", "history_settings")
    POOL_FIELD_NUMBER: _ClassVar[int]
    QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    SUCCESSES_PER_QUESTION_FIELD_NUMBER: _ClassVar[int]
    MEAN_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STD_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    PER_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    REDIS_USED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PER_QUESTION_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    QUESTIONS_WITH_HISTORY_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    RESCUES_FIELD_NUMBER: _ClassVar[int]
    MASTERED_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    NEVER_SOLVED_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_REPORTS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_ROWS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    questions: int
    trajectories: int
    successes_per_question: _containers.RepeatedCompositeFieldContainer[CountBucket]
    mean_response_tokens: float
    std_response_tokens: float
    response_token_histogram: _containers.RepeatedCompositeFieldContainer[CountBucket]
    per_policy_version: _containers.RepeatedCompositeFieldContainer[CountBucket]
    payload_bytes: int
    redis_used_memory_bytes: int
    capacity_per_question: int
    eviction: str
    questions_with_history: int
    pass_rate_histogram: _containers.RepeatedCompositeFieldContainer[CountBucket]
    rescues: int
    mastered_questions: int
    never_solved_questions: int
    history_reports: int
    replayed_rows: int
    history_settings: HistorySettings
    def __init__(self, pool: _Optional[str] = ..., questions: _Optional[int] = ..., trajectories: _Optional[int] = ..., successes_per_question: _Optional[_Iterable[_Union[CountBucket, _Mapping]]] = ..., mean_response_tokens: _Optional[float] = ..., std_response_tokens: _Optional[float] = ..., response_token_histogram: _Optional[_Iterable[_Union[CountBucket, _Mapping]]] = ..., per_policy_version: _Optional[_Iterable[_Union[CountBucket, _Mapping]]] = ..., payload_bytes: _Optional[int] = ..., redis_used_memory_bytes: _Optional[int] = ..., capacity_per_question: _Optional[int] = ..., eviction: _Optional[str] = ..., questions_with_history: _Optional[int] = ..., pass_rate_histogram: _Optional[_Iterable[_Union[CountBucket, _Mapping]]] = ..., rescues: _Optional[int] = ..., mastered_questions: _Optional[int] = ..., never_solved_questions: _Optional[int] = ..., history_reports: _Optional[int] = ..., replayed_rows: _Optional[int] = ..., history_settings: _Optional[_Union[HistorySettings, _Mapping]] = ...) -> None: ...

class HistorySettings(_message.Message):
    __slots__ = ("window", "ema_alpha", "mastered_pass_rate", "mastered_min_visits")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    EMA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    MASTERED_PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    MASTERED_MIN_VISITS_FIELD_NUMBER: _ClassVar[int]
    window: int
    ema_alpha: float
    mastered_pass_rate: float
    mastered_min_visits: int
    def __init__(self, window: _Optional[int] = ..., ema_alpha: _Optional[float] = ..., mastered_pass_rate: _Optional[float] = ..., mastered_min_visits: _Optional[int] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pools: _Optional[_Iterable[str]] = ...) -> None: ...

class DropPoolRequest(_message.Message):
    __slots__ = ("pool", "confirm")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_FIELD_NUMBER: _ClassVar[int]
    pool: str
    confirm: str
    def __init__(self, pool: _Optional[str] = ..., confirm: _Optional[str] = ...) -> None: ...

class DropPoolResponse(_message.Message):
    __slots__ = ("deleted_trajectories",)
    DELETED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    deleted_trajectories: int
    def __init__(self, deleted_trajectories: _Optional[int] = ...) -> None: ...

class ExportPoolRequest(_message.Message):
    __slots__ = ("pool", "questions_per_chunk")
    POOL_FIELD_NUMBER: _ClassVar[int]
    QUESTIONS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    pool: str
    questions_per_chunk: int
    def __init__(self, pool: _Optional[str] = ..., questions_per_chunk: _Optional[int] = ...) -> None: ...

class PoolChunk(_message.Message):
    __slots__ = ("pool", "questions", "trajectories", "histories")
    POOL_FIELD_NUMBER: _ClassVar[int]
    QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    HISTORIES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    questions: _containers.RepeatedCompositeFieldContainer[Question]
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    histories: _containers.RepeatedCompositeFieldContainer[QuestionHistory]
    def __init__(self, pool: _Optional[str] = ..., questions: _Optional[_Iterable[_Union[Question, _Mapping]]] = ..., trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ..., histories: _Optional[_Iterable[_Union[QuestionHistory, _Mapping]]] = ...) -> None: ...

class QuestionOutcome(_message.Message):
    __slots__ = ("question_id", "attempts", "successes", "mean_reward", "replayed", "rescued")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    RESCUED_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    attempts: int
    successes: int
    mean_reward: float
    replayed: int
    rescued: bool
    def __init__(self, question_id: _Optional[str] = ..., attempts: _Optional[int] = ..., successes: _Optional[int] = ..., mean_reward: _Optional[float] = ..., replayed: _Optional[int] = ..., rescued: _Optional[bool] = ...) -> None: ...

class ReportOutcomesRequest(_message.Message):
    __slots__ = ("pool", "run_id", "step", "policy_version", "outcomes", "questions")
    POOL_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    run_id: str
    step: int
    policy_version: int
    outcomes: _containers.RepeatedCompositeFieldContainer[QuestionOutcome]
    questions: _containers.RepeatedCompositeFieldContainer[Question]
    def __init__(self, pool: _Optional[str] = ..., run_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., outcomes: _Optional[_Iterable[_Union[QuestionOutcome, _Mapping]]] = ..., questions: _Optional[_Iterable[_Union[Question, _Mapping]]] = ...) -> None: ...

class ReportOutcomesResponse(_message.Message):
    __slots__ = ("recorded", "duplicate", "last_step")
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    recorded: int
    duplicate: bool
    last_step: int
    def __init__(self, recorded: _Optional[int] = ..., duplicate: _Optional[bool] = ..., last_step: _Optional[int] = ...) -> None: ...

class GetQuestionStatsRequest(_message.Message):
    __slots__ = ("pool", "question_ids", "filter", "min_pass_rate", "max_pass_rate", "limit", "cursor")
    POOL_FIELD_NUMBER: _ClassVar[int]
    QUESTION_IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    MIN_PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    pool: str
    question_ids: _containers.RepeatedScalarFieldContainer[str]
    filter: QuestionFilter
    min_pass_rate: float
    max_pass_rate: float
    limit: int
    cursor: str
    def __init__(self, pool: _Optional[str] = ..., question_ids: _Optional[_Iterable[str]] = ..., filter: _Optional[_Union[QuestionFilter, str]] = ..., min_pass_rate: _Optional[float] = ..., max_pass_rate: _Optional[float] = ..., limit: _Optional[int] = ..., cursor: _Optional[str] = ...) -> None: ...

class QuestionHistory(_message.Message):
    __slots__ = ("question_id", "visits", "attempts", "successes", "reward_sum", "window_attempts", "window_successes", "pass_rate", "ema_pass_rate", "first_step", "last_step", "first_policy_version", "last_policy_version", "times_replayed", "replayed_rows", "times_rescued", "last_solved_step", "mastered")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    VISITS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    REWARD_SUM_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    EMA_PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    FIRST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMES_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMES_RESCUED_FIELD_NUMBER: _ClassVar[int]
    LAST_SOLVED_STEP_FIELD_NUMBER: _ClassVar[int]
    MASTERED_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    visits: int
    attempts: int
    successes: int
    reward_sum: float
    window_attempts: _containers.RepeatedScalarFieldContainer[int]
    window_successes: _containers.RepeatedScalarFieldContainer[int]
    pass_rate: float
    ema_pass_rate: float
    first_step: int
    last_step: int
    first_policy_version: int
    last_policy_version: int
    times_replayed: int
    replayed_rows: int
    times_rescued: int
    last_solved_step: int
    mastered: bool
    def __init__(self, question_id: _Optional[str] = ..., visits: _Optional[int] = ..., attempts: _Optional[int] = ..., successes: _Optional[int] = ..., reward_sum: _Optional[float] = ..., window_attempts: _Optional[_Iterable[int]] = ..., window_successes: _Optional[_Iterable[int]] = ..., pass_rate: _Optional[float] = ..., ema_pass_rate: _Optional[float] = ..., first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., first_policy_version: _Optional[int] = ..., last_policy_version: _Optional[int] = ..., times_replayed: _Optional[int] = ..., replayed_rows: _Optional[int] = ..., times_rescued: _Optional[int] = ..., last_solved_step: _Optional[int] = ..., mastered: _Optional[bool] = ...) -> None: ...

class GetQuestionStatsResponse(_message.Message):
    __slots__ = ("questions", "next_cursor", "matching")
    QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    MATCHING_FIELD_NUMBER: _ClassVar[int]
    questions: _containers.RepeatedCompositeFieldContainer[QuestionHistory]
    next_cursor: str
    matching: int
    def __init__(self, questions: _Optional[_Iterable[_Union[QuestionHistory, _Mapping]]] = ..., next_cursor: _Optional[str] = ..., matching: _Optional[int] = ...) -> None: ...
