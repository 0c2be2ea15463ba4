"""Which scorer judges an item, and what its result is worth: the verifier's `data_source` routing.

`Scorers` sends each item to the scorer its `data_source` names in `VerifierConfig.scorers` (an empty or
unlisted label gets `default_scorer`, math-verify unless configured otherwise), as verl's `default_compute_score`
routes. math-verify and Python scorers run in the worker pool (same processes, same limits); HTTP scorers run
on their own threads. All of one call's items fill one `VerifyBatch`, so the call's deadline and cancellation
cover every scorer alike.

Rewards: math keeps `reward_correct` / `reward_wrong` by verdict (score 1 or 0); other scorers' reward is their
score, or their `error_reward` when they failed (ERROR, TIMEOUT; score 0).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlep.common.types import Verdict
from rlep.services.verifier.client import ScoredItem
from rlep.services.verifier.config import HttpScorer, MathScorer, PythonScorer, ScorerSpec, VerifierConfig
from rlep.services.verifier.http_scorer import RemoteScorer
from rlep.services.verifier.judge import CheckResult, reward_of
from rlep.services.verifier.pool import VerifyBatch, VerifyPool
from rlep.services.verifier.python_scorer import ScoreCall, load_function, parse_extra

log = logging.getLogger(__name__)

_DEFAULT = ""  # the route of `default_scorer` (no data_source)
DEFAULT_LABEL = "default"  # its `scorer` label on the metrics
FIRST_FAILURES_LOGGED = 3  # per scorer, each with its message; then one summary line per FAILURE_LOG_EVERY_S
FAILURE_LOG_EVERY_S = 60.0


def scorer_label(route: str) -> str:
    return route or DEFAULT_LABEL


def scorer_labels(config: VerifierConfig) -> list[str]:
    """Every value the metrics' `scorer` label can take: a closed set, the config's routes."""
    return [*map(scorer_label, config.scorers), DEFAULT_LABEL]


@dataclass(frozen=True)
class Scored:
    result: CheckResult
    reward: float
    score: float
    scorer: str
    """The `scorer` label: the data_source key it was routed by, or "default"."""


class FailureLog:
    """Logs why scorers other than math-verify fail, rate-limited per scorer: a scorer that raises on every item
    must be visible (it was ERROR and reward 0 with nothing logged) without one line per item."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock, self._lock = clock, threading.Lock()
        self._seen: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def record(self, scorer: str, result: CheckResult) -> None:
        if not result.error:
            return
        with self._lock:
            seen = self._seen[scorer] = self._seen.get(scorer, 0) + 1
            now = self._clock()
            if seen <= FIRST_FAILURES_LOGGED:
                self._last[scorer] = now
                log.warning("scorer %s: item %s: %s", scorer, result.verdict.value.upper(), result.error)
                return
            self._unlogged[scorer] = self._unlogged.get(scorer, 0) + 1
            if now - self._last[scorer] < FAILURE_LOG_EVERY_S:
                return
            unlogged, self._unlogged[scorer], self._last[scorer] = self._unlogged[scorer], 0, now
        log.warning(
            "scorer %s: %d more failed items (%d in all), the latest %s: %s",
            scorer, unlogged, seen, result.verdict.value.upper(), result.error,
        )  # fmt: skip


class RoutedBatch:
    """One call's items across scorers: wait for them in order, or cancel the rest."""

    def __init__(self, batch: VerifyBatch, routes: list[str], scorers: Scorers):
        self._batch, self._routes, self._scorers = batch, routes, scorers

    def wait(self, timeout_s: float | None = None) -> list[Scored]:
        """Raises TimeoutError / CancelledError as `VerifyBatch.wait` does."""
        results = self._batch.wait(timeout_s)
        scored = []
        for route, result in zip(self._routes, results, strict=True):
            label = scorer_label(route)
            self._scorers.failures.record(label, result)
            scored.append(score_result(self._scorers.spec(route), result, self._scorers.config, label))
        return scored

    def cancel(self) -> None:
        self._batch.cancel()


def score_result(spec: ScorerSpec, result: CheckResult, config: VerifierConfig, scorer: str = DEFAULT_LABEL) -> Scored:
    """An item's reward and score from its scorer's result (see the module docstring)."""
    if isinstance(spec, MathScorer):
        correct = result.verdict == Verdict.CORRECT
        reward = reward_of(result.verdict, config.reward_correct, config.reward_wrong)
        return Scored(result, reward, float(correct), scorer)
    if result.score is None:
        return Scored(result, spec.error_reward, 0.0, scorer)
    return Scored(result, result.score, result.score, scorer)


class Scorers:
    """Routes items to math-verify, Python and HTTP scorers by their data_source.

    Args:
        config: the verifier's config (`scorers`, `default_scorer`, rewards).
        pool: the worker pool running math-verify and the Python scorers.
        on_skip: called once per HTTP-scored item dropped because its call ended (metrics).

    Raises ValueError at construction when a Python scorer's function cannot be imported (fail at start, not per
    item), or an HTTP scorer's token file cannot be read.
    """

    def __init__(self, config: VerifierConfig, pool: VerifyPool, on_skip: Callable[[], None] | None = None):
        self.config, self._pool = config, pool
        self.failures = FailureLog()
        self._routes: dict[str, ScorerSpec] = {**config.scorers, _DEFAULT: config.default_scorer}
        self._remote: dict[str, RemoteScorer] = {}
        for route, spec in self._routes.items():
            if isinstance(spec, PythonScorer):
                load_function(spec.function)
            elif isinstance(spec, HttpScorer):
                self._remote[route] = RemoteScorer(spec, route, config.max_answer_chars, on_skip)

    def route_of(self, data_source: str) -> str:
        return data_source if data_source in self._routes else _DEFAULT

    def spec(self, route: str) -> ScorerSpec:
        return self._routes[route]

    def start(self, items: Sequence[ScoredItem], use_cache: bool = True) -> RoutedBatch:
        """Starts scoring every item. Raises ValueError, before any work, when an item's `extra` is not a JSON
        object."""
        for position, item in enumerate(items):
            try:
                parse_extra(item.extra)
            except ValueError as err:
                raise ValueError(f"item {position}: extra is not a JSON object: {err}") from None
        routes = [self.route_of(item.data_source) for item in items]
        specs = [self._routes[route] for route in routes]
        pooled: list[tuple[int, tuple[str, str] | ScoreCall]] = []
        remote: dict[str, list[tuple[int, tuple[str, str, str]]]] = {}
        for position, (item, route, spec) in enumerate(zip(items, routes, specs, strict=True)):
            if isinstance(spec, MathScorer):
                pooled.append((position, (item.response, item.ground_truth)))
            elif isinstance(spec, PythonScorer):
                call = ScoreCall(spec.function, item.response, item.ground_truth, item.extra, spec.success_threshold)
                pooled.append((position, call))
            else:
                remote.setdefault(route, []).append((position, (item.response, item.ground_truth, item.extra)))
        batch = VerifyBatch(len(items))
        self._pool.submit(batch, pooled, use_cache)
        for route, positions in remote.items():
            self._remote[route].submit(batch, positions)
        return RoutedBatch(batch, routes, self)

    def close(self) -> None:
        for scorer in self._remote.values():
            scorer.close()
