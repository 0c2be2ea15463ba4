"""Configuration of the replay service."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlep.common.config import ServerConfig, StrictModel
from rlep.services.replay.sampling import Eviction

DEFAULT_PORT = 50062


class ReplayConfig(StrictModel):
    server: ServerConfig = ServerConfig(port=DEFAULT_PORT)
    """Where the gRPC server listens."""
    redis_url: str | None = None
    """Redis to use, e.g. redis://:password@host:6379/0. None starts a local redis-server (embedded default)."""
    local_redis_dir: Path = Path.home() / ".cache" / "rlep" / "redis"
    """Data directory (AOF) of the self-started redis-server."""
    local_redis_appendfsync: Literal["always", "everysec"] = "always"
    """fsync policy of the self-started server: `always` loses no acknowledged add on a crash."""
    capacity_per_question: int = Field(64, ge=1, le=100_000)
    """Successes kept per question; adding beyond evicts one (see `eviction`). Applies to new pools."""
    eviction: Eviction = Eviction.OLDEST
    """Which success a full question drops: the oldest, or the one with the lowest priority."""
    max_m: int = Field(256, ge=1)
    """Largest M accepted by Sample."""
    max_questions_per_sample: int = Field(65_536, ge=1)
    """Largest number of question ids in one Sample call."""
    max_sample_trajectories: int = Field(65_536, ge=1)
    """Most trajectories one Sample may ask for (question ids x m, repeats counted); beyond it the call gets
    RESOURCE_EXHAUSTED before any work."""
    max_sample_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024)
    """Most bytes of trajectories one Sample may read from Redis or return (RESOURCE_EXHAUSTED beyond).
    Must stay under the server's send limit (twice `server.max_request_bytes`)."""
    max_diverse_pairs: int = Field(1 << 22, ge=1)
    """Most success pairs one `diverse` Sample may compare (sum over questions of stored successes squared:
    B=512 questions at 64 successes each is 2^21). Its time and memory grow with it."""
    max_question_bytes: int = Field(256 * 1024, ge=1024)
    """Largest serialized Question (prompt, gold answer, source) accepted with an add."""
    max_trajectory_bytes: int = Field(1 << 20, ge=1024)
    """Serialized trajectories above this are rejected (reason "oversize")."""
    max_trajectories_per_add: int = Field(20_000, ge=1)
    """Largest number of trajectories in one AddTrajectories call (ImportPool chunks alike)."""
    redis_timeout_s: float = Field(10.0, gt=0)
    """Socket timeout of Redis calls; past it the RPC fails with UNAVAILABLE (retriable)."""
    history_window: int = Field(8, ge=1, le=64)
    """Per-question history: visits (reports naming the question) kept in its recent window, whose pass rate
    GetQuestionStats filters and GetPoolStats buckets by. Fixed for a pool when its history starts."""
    history_ema_alpha: float = Field(0.25, gt=0, le=1)
    """Weight of the newest visit's pass rate in a question's EMA pass rate. Fixed for a pool as above."""
    mastered_pass_rate: float = Field(0.9, gt=0, le=1)
    """A question is mastered when its recent pass rate is at least this over at least `mastered_min_visits`
    visits in the window. Fixed for a pool as above (its count is kept as reports land)."""
    mastered_min_visits: int = Field(4, ge=1, le=64)
    """See `mastered_pass_rate`; at most `history_window`."""
    max_outcomes_per_report: int = Field(8192, ge=1, le=65_536)
    """Most questions in one ReportOutcomes (INVALID_ARGUMENT beyond) or named by one GetQuestionStats. A report
    is one atomic Lua call, which holds Redis for about 8 us a question (4 ms for 512, ~65 ms at this default)."""
    max_history_runs: int = Field(10_000, ge=1)
    """Runs whose last reported step a pool remembers (the duplicate check); past it the run that reported
    least recently is forgotten, and a retry of its last step would count again."""

    @model_validator(mode="after")
    def check_sample_bytes_fit_a_reply(self) -> ReplayConfig:
        # rlep.common.grpc_server.CHANNEL_LIMIT_FACTOR (not imported: configs load without grpc).
        send_limit = self.server.max_request_bytes * 2
        if self.max_sample_bytes >= send_limit:
            raise ValueError(
                f"max_sample_bytes ({self.max_sample_bytes}) must be below the server's send limit "
                f"({send_limit} bytes, twice server.max_request_bytes)"
            )
        return self

    @model_validator(mode="after")
    def check_mastered_fits_the_window(self) -> ReplayConfig:
        if self.mastered_min_visits > self.history_window:
            raise ValueError(
                f"mastered_min_visits ({self.mastered_min_visits}) must be at most history_window "
                f"({self.history_window}): the window holds the visits it counts"
            )
        return self
