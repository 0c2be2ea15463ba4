"""Configuration of the verifier service, and of the scorers it routes items to by `data_source`."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from rlep.common.config import ServerConfig, StrictModel

DEFAULT_PORT = 50061
_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class MathScorer(StrictModel):
    """math-verify (the paper's scorer): reward `reward_correct` for CORRECT, else `reward_wrong`; score 1 or 0."""

    type: Literal["math"] = "math"


class ScoreRule(StrictModel):
    """What a scorer's number means for the learner: reward = score; success = score >= `success_threshold`."""

    success_threshold: float = 1.0
    """Scores at or above it are CORRECT (a success: the replay pool keeps it, eval counts it), others WRONG."""
    error_reward: float = 0.0
    """Reward of an item the scorer could not score (ERROR or TIMEOUT verdict)."""


class PythonScorer(ScoreRule):
    """A Python function `(response, ground_truth, extra) -> float | dict` run in the verifier's worker processes,
    under the same limits as math-verify (CPU time, memory, the hard wall-clock kill)."""

    type: Literal["python"] = "python"
    function: str
    """`module:function`, importable by the verifier (e.g. `rlep.services.verifier.countdown:score`). A
    dict result needs a finite `score` and may carry an `extracted_answer` string."""

    @model_validator(mode="after")
    def _function_path(self) -> PythonScorer:
        if not _FUNCTION_PATH.fullmatch(self.function):
            raise ValueError(f"function {self.function!r} must be 'module:function'")
        return self


# Tasks whose scorer ships with RLEP, routed by their data_source out of the box (as verl's default_compute_score).
BUILTIN_SCORERS = {"countdown": PythonScorer(function="rlep.services.verifier.countdown:score")}


class HttpScorer(ScoreRule):
    """A remote scorer (e.g. a reward model served elsewhere): POSTs of `batch_size` items, bounded and retried."""

    type: Literal["http"] = "http"
    url: str = Field(pattern=r"^https?://")
    """Endpoint taking `{"response", "ground_truth", "extra", "data_source"}` and answering a finite number or
    `{"score": number, "extracted_answer"?: string}` as JSON."""
    auth_token_file: Path | None = None
    """File holding the bearer token sent as `authorization: Bearer <token>` (read at start, never logged)."""
    timeout_s: float = Field(10.0, gt=0, le=600)
    """Limit of one attempt (connect + answer)."""
    retries: int = Field(2, ge=0, le=10)
    """Further attempts after a 5xx, a 429, a timeout or a connection error (never after another 4xx)."""
    backoff_s: float = Field(0.5, ge=0, le=60)
    """Wait before the first retry; doubled before each later one."""
    max_concurrency: int = Field(8, ge=1, le=1024)
    """Requests in flight to this scorer at once (its own thread pool)."""
    max_response_bytes: int = Field(65_536, ge=16)
    """Per item: an answer longer than this times the items it scores is an ERROR."""
    batch_size: int = Field(1, ge=1, le=4096)
    """Items per POST. 1: the body is one item and the answer one score; more: the body is a JSON list of up to
    this many items and the answer a list of as many scores, in order (one request, one reward-model batch)."""


ScorerSpec = Annotated[MathScorer | PythonScorer | HttpScorer, Field(discriminator="type")]


class ScorerSettings(StrictModel):
    """Which scorer judges which item, and where the verifier finds scorer modules of your own. A section of its
    own so that `rlep train` and `rlep collect` can give it to the verifier they start (TrainConfig.verifier)."""

    scorers: dict[str, ScorerSpec] = Field(default_factory=lambda: dict(BUILTIN_SCORERS))
    """`data_source` -> scorer (`type`: math, python or http), as verl's `default_compute_score` routes. An item
    whose data_source is empty or not listed here gets `default_scorer`: datasets relabel their sources
    (DAPO-Math-17k says `DAPO-17k`, RLEP's pool `dapo_math`), so an unlisted label must not fail a step. By
    default the built-in `countdown` task is listed (math-verify could not judge it anyway); a `scorers` you set
    replaces the default mapping."""
    default_scorer: ScorerSpec = MathScorer()
    """The scorer of items whose data_source has no entry in `scorers`."""

    scorer_path: list[Path] = []
    """Folders searched for `python` scorers' modules before the installed packages (as PYTHONPATH would, but for
    the verifier and its workers only). Relative folders are taken from the directory the command runs in."""

    def routing_of(self, data_sources: Iterable[str]) -> tuple[str, ...]:
        """How items with these data_source labels will be scored, one line per label that falls to
        `default_scorer` (none, or one `scorers` does not list), with its count: said at a run's start so that
        data silently scored by math-verify shows. Empty when every label has a scorer of its own."""
        default = self.default_scorer.type
        counts = Counter(data_sources)
        unlisted = sorted((source, count) for source, count in counts.items() if source not in self.scorers)
        return tuple(
            f"{count} questions with data_source {source!r}: not in verifier.scorers, scored by {default}"
            if source
            else f"{count} questions without a data_source: scored by default_scorer ({default})"
            for source, count in unlisted
        )

    @field_validator("scorer_path")
    @classmethod
    def _absolute_folders(cls, folders: list[Path]) -> list[Path]:
        return [folder.expanduser().absolute() for folder in folders]


class VerifierConfig(ScorerSettings):
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
        return self.server.call_slots(self.max_calls_in_flight)

    @model_validator(mode="after")
    def _calls_leave_threads(self) -> VerifierConfig:
        self.server.call_slots(self.max_calls_in_flight)  # ValueError when no thread is left for health checks
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
