"""A question's history as plain data, with no Redis: the outcome a step reports, the record the pool keeps, a query.

The record's stored form is binary (`RECORD_HEAD`: the `RECORD_FIELDS` as big-endian doubles and the window's
length, then its attempts and successes as big-endian uint32, oldest visit first; at most 105 + 8 x 64 bytes); the
Lua scripts of `history_lua.py` read and write the same form with Redis's `struct`. Derived
figures (the recent pass rate, mastered) are computed from it, never stored, so they cannot disagree with it.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

RECORD_FIELDS = (
    "visits",
    "attempts",
    "successes",
    "reward_sum",
    "ema",
    "first_step",
    "last_step",
    "first_version",
    "last_version",
    "times_replayed",
    "replayed_rows",
    "times_rescued",
    "last_solved_step",
)
FLOAT_FIELDS = frozenset({"reward_sum", "ema"})
RECORD_HEAD = struct.Struct(f">{len(RECORD_FIELDS)}dB")
PASS_RATE_BUCKETS = 10
MAX_WINDOW = 64  # the largest `history_window` a config may set; an imported record's window is bounded by it


class QuestionFilter(enum.Enum):
    ALL = "all"
    BAND = "band"  # recent pass rate in [min_pass_rate, max_pass_rate]
    NEVER_SOLVED = "never_solved"
    MASTERED = "mastered"


@dataclass(frozen=True)
class HistorySettings:
    """How a pool keeps history, fixed when its history starts (`ReplayConfig.history_*`, `mastered_*`)."""

    window: int
    ema_alpha: float
    mastered_pass_rate: float
    mastered_min_visits: int


@dataclass(frozen=True)
class Outcome:
    """One question's fresh outcome in one step (checked by `requests.check_report`)."""

    question_id: str
    attempts: int
    successes: int
    mean_reward: float
    replayed: int
    rescued: bool


@dataclass(frozen=True)
class QuestionQuery:
    """A GetQuestionStats request, checked: the named questions, or one page of a filter."""

    question_ids: tuple[str, ...] = ()
    filter: QuestionFilter = QuestionFilter.ALL
    min_pass_rate: float = 0.0
    max_pass_rate: float = 1.0
    limit: int = 100
    cursor: str = ""


@dataclass(frozen=True)
class QuestionRecord:
    """What the pool keeps about one question; `window_*`: the recent visits, oldest first."""

    question_id: str
    visits: int
    attempts: int
    successes: int
    reward_sum: float
    ema: float
    first_step: int
    last_step: int
    first_version: int
    last_version: int
    times_replayed: int
    replayed_rows: int
    times_rescued: int
    last_solved_step: int  # -1: never
    window_attempts: tuple[int, ...]
    window_successes: tuple[int, ...]

    @property
    def pass_rate(self) -> float:
        """Recent pass rate: successes over attempts in the window."""
        return sum(self.window_successes) / sum(self.window_attempts)

    def mastered(self, settings: HistorySettings) -> bool:
        return (
            len(self.window_attempts) >= settings.mastered_min_visits and self.pass_rate >= settings.mastered_pass_rate
        )

    def encode(self) -> bytes:
        numbers = [float(getattr(self, name)) for name in RECORD_FIELDS]
        window = (*self.window_attempts, *self.window_successes)
        head = RECORD_HEAD.pack(*numbers, len(self.window_attempts))
        return head + struct.pack(f">{len(window)}I", *window)

    @classmethod
    def decode(cls, question_id: str, data: bytes) -> QuestionRecord:
        *numbers, visits = RECORD_HEAD.unpack_from(data)
        values = {name: x if name in FLOAT_FIELDS else int(x) for name, x in zip(RECORD_FIELDS, numbers, strict=True)}
        window = struct.unpack_from(f">{2 * visits}I", data, RECORD_HEAD.size)
        return cls(question_id, **values, window_attempts=window[:visits], window_successes=window[visits:])


def rate_key(rate: float) -> str:
    """A pass rate as the history index sorts it: its IEEE-754 bits, big-endian, in hex (non-negative doubles
    sort as their numbers do), so a band [lo, hi] is one lexical range."""
    return struct.pack(">d", rate).hex()


def pass_rate_bucket_labels() -> list[str]:
    """The histogram's labels: "0.0-0.1" .. "0.9-1.0"."""
    return [f"{b / PASS_RATE_BUCKETS:.1f}-{(b + 1) / PASS_RATE_BUCKETS:.1f}" for b in range(PASS_RATE_BUCKETS)]
