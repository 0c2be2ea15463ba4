"""Configuration of the verifier service."""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from rlep.common.config import ServerConfig, StrictModel

DEFAULT_PORT = 50061


class VerifierConfig(StrictModel):
    server: ServerConfig = ServerConfig(port=DEFAULT_PORT)
    """Where the gRPC server listens."""
    num_workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1, le=256)
    """Worker processes running math-verify (CPU-bound: one per core)."""
    item_timeout_s: float = Field(5.0, gt=0, le=3600)
    """Hard wall-clock limit for checking one response; past it the worker is killed and replaced (TIMEOUT).

    A backstop for input stuck in C code. It counts wall time, so keep it several times the CPU time an
    item may use (3 x parse_timeout_s): the margin is how much slower a busy machine may run before a
    legal answer's verdict changes."""
    parse_timeout_s: float = Field(1.0, gt=0, le=600)
    """CPU-time limit (seconds) of each math-verify step: gold parse, answer parse, comparison. Past it the
    item is TIMEOUT. CPU time, not wall time, so the verdict does not depend on the machine's load."""
    request_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """The server's own limit for one Verify call: it applies when the caller sets no deadline or a later
    one. Past it the call gets RESOURCE_EXHAUSTED and its unchecked items are dropped."""
    max_answer_chars: int = Field(512, ge=1)
    """Extracted answers longer than this are UNPARSEABLE without being parsed."""
    max_items_per_request: int = Field(8192, ge=1)
    """Larger batches get INVALID_ARGUMENT (the client splits big batches for you)."""
    worker_memory_mb: int = Field(4096, ge=0)
    """Address-space limit per worker in MiB (0 = unlimited); runaway inputs get ERROR, not an OOM."""
    verdict_cache_size: int = Field(65_536, ge=0, le=10_000_000)
    """Verdicts kept in the server process by (extracted answer, gold answer), least recently used first out;
    0 turns it off, and with it the sharing of one check among identical items in flight. Only verdicts that
    are functions of that pair are kept (correct, wrong, unparseable, gold_unparseable), so a hit returns what
    a fresh check would. An entry holds two strings of at most max_answer_chars: ~0.2 KB typical, ~2 KB worst."""
    parse_cache_size: int = Field(4096, ge=0, le=1_000_000)
    """Parsed gold answers, and as many parsed extracted answers, kept in each worker (LRU; 0 = none). Items
    go to the worker that owns their gold answer, so a question's G responses parse it once."""
    max_calls_in_flight: int | None = Field(None, ge=1)
    """Verify calls served at once; one more gets UNAVAILABLE ("busy", which clients retry) at once. Each call waits
    on a gRPC thread until its items are done, so without a bound 16 slow calls took every thread and the health
    check timed out. None = `server.grpc_threads` - 2 (two threads always free for health checks and other calls)."""
    reward_correct: float = 1.0
    """Reward of a CORRECT verdict."""
    reward_wrong: float = -1.0
    """Reward of every other verdict (DAPO's verl recipe uses -1)."""

    @property
    def call_slots(self) -> int:
        return self.max_calls_in_flight or max(1, self.server.grpc_threads - 2)

    @model_validator(mode="after")
    def _calls_leave_threads(self) -> VerifierConfig:
        if self.call_slots >= self.server.grpc_threads:
            raise ValueError(
                f"max_calls_in_flight ({self.call_slots}) must stay below server.grpc_threads "
                f"({self.server.grpc_threads}): the health check needs a thread"
            )
        return self

    @model_validator(mode="after")
    def _timeouts_nest(self) -> VerifierConfig:
        # One check runs up to three math-verify steps (gold parse, answer parse, compare), each limited
        # in CPU time; the wall-clock kill must come later, or it would decide instead.
        if 3 * self.parse_timeout_s >= self.item_timeout_s:
            raise ValueError(
                f"item_timeout_s ({self.item_timeout_s}) must exceed 3 x parse_timeout_s ({self.parse_timeout_s}) "
                "so the CPU-time limit of the steps decides before the worker is killed"
            )
        return self
