"""Verifier logic: pull the final answer out of a response and decide it against the gold answer.

Answer extraction follows the RLEP/DAPO conventions: the last `\\boxed{...}` (or `\\fbox{...}`) with
balanced braces; failing that, the last "Answer: X" line (DAPO-Math's prompt format). Equivalence
is decided by HF math-verify (symbolic and numeric comparison through sympy).

`check_answer` must run on a process's main thread: it limits each math-verify step by the CPU time
of the process (`signal.setitimer(ITIMER_PROF)`), in place of math-verify's own `signal.alarm`
timeouts, which count wall time and so turned slow-but-legal answers into TIMEOUT whenever the
machine was busy. The process must not run other busy threads (they would use up the budget). The
service runs checks in worker processes (`rlep.services.verifier.pool`) and adds a hard wall-clock
per-item timeout on top, because a pathological input can block inside C code where no signal
handler runs.

What is not covered: answers that are only stated in prose ("the answer is seven"), multiple-choice
letter matching beyond what math-verify does, and responses with several conflicting boxed answers
(only the last counts). An unbalanced last `\\boxed{` is treated as no boxed answer at all.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rlep.common.answers import extract_answer
from rlep.common.types import Verdict


@dataclass(frozen=True)
class CheckOptions:
    """Limits of one check; picklable so it can be sent to worker processes."""

    max_answer_chars: int = 512
    """Longer extracted answers are UNPARSEABLE without parsing (real answers are short)."""
    parse_timeout_s: float = 1.0
    """CPU-time limit of each math-verify step (gold parse, answer parse, comparison), in seconds."""


@dataclass(frozen=True)
class CheckResult:
    verdict: Verdict
    extracted_answer: str
    seconds: float = 0.0


@contextlib.contextmanager
def cpu_time_limit(seconds: float) -> Iterator[None]:
    """Raises math-verify's `TimeoutException` once the process has spent `seconds` of CPU time in the block.

    CPU time, not wall time, so a verdict does not depend on what else the machine runs. Main thread only
    (signal handlers run there). The exception may surface just after the block ends: callers catch it
    around the block, not inside.
    """
    from math_verify.errors import TimeoutException

    def expire(signum: int, frame: object) -> None:
        raise TimeoutException(f"over {seconds} s of CPU time")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str, timeout_s: float) -> tuple:
    """Parses a gold answer; cached because every one of a question's G responses shares it.

    math-verify falls back to the raw string when it cannot build an expression; a gold answer
    with no expression at all (e.g. "???") cannot be judged, so it comes back empty.
    """
    from math_verify import parse

    for candidate in (f"${ground_truth}$", f"\\boxed{{{ground_truth}}}"):
        with cpu_time_limit(timeout_s):
            parsed = parse(candidate, parsing_timeout=None)  # None: our CPU-time limit replaces its alarm
        if any(not isinstance(p, str) for p in parsed):
            return tuple(parsed)
    return ()


def clear_gold_cache() -> None:
    """Forgets parsed gold answers (each worker parses a gold answer once; benchmarks time cold parses)."""
    _parse_gold.cache_clear()


def check_answer(response: str, ground_truth: str, options: CheckOptions = CheckOptions()) -> CheckResult:
    """Decides one response. Never raises for bad input: every outcome is a verdict."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    if threading.current_thread() is not threading.main_thread():
        # The CPU-time limit is a signal handler; elsewhere every check would fail as UNPARSEABLE.
        raise RuntimeError("check_answer must run on a process's main thread (see rlep.services.verifier.pool)")

    started = time.perf_counter()

    def done(verdict: Verdict, extracted: str) -> CheckResult:
        return CheckResult(verdict, extracted, time.perf_counter() - started)

    extracted = extract_answer(response)
    if extracted is None:
        return done(Verdict.UNPARSEABLE, "")
    if len(extracted) > options.max_answer_chars:
        return done(Verdict.UNPARSEABLE, extracted[: options.max_answer_chars])
    gold_text = ground_truth.strip()
    if not gold_text or len(gold_text) > options.max_answer_chars:
        return done(Verdict.GOLD_UNPARSEABLE, extracted)
    try:
        gold = _parse_gold(gold_text, options.parse_timeout_s)
        if not gold:
            return done(Verdict.GOLD_UNPARSEABLE, extracted)
        with cpu_time_limit(options.parse_timeout_s):
            predicted = parse(f"\\boxed{{{extracted}}}", parsing_timeout=None, raise_on_error=True)
    except TimeoutException:
        return done(Verdict.TIMEOUT, extracted)
    except Exception:  # sympy/antlr fail in many ways on odd input: it is not a parseable answer
        return done(Verdict.UNPARSEABLE, extracted)
    if not predicted:
        return done(Verdict.UNPARSEABLE, extracted)
    try:
        with cpu_time_limit(options.parse_timeout_s):
            same = verify(list(gold), predicted, timeout_seconds=None, raise_on_error=True)
    except TimeoutException:
        return done(Verdict.TIMEOUT, extracted)
    except Exception:  # parsed but not comparable (e.g. a matrix against a number): not equivalent
        same = False
    return done(Verdict.CORRECT if same else Verdict.WRONG, extracted)


def reward_of(verdict: Verdict, reward_correct: float, reward_wrong: float) -> float:
    return reward_correct if verdict == Verdict.CORRECT else reward_wrong
