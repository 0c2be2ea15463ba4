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

A check splits in two so that the service can skip repeated work: `prepare_check` (string work, any
thread) yields a `CheckKey` (extracted answer, stripped gold answer) that, with the options, determines
the verdict; `check_key` runs math-verify on it, with an optional per-process `ParseCache`.

What is not covered: answers that are only stated in prose ("the answer is seven"), multiple-choice
letter matching beyond what math-verify does, and responses with several conflicting boxed answers
(only the last counts). An unbalanced last `\\boxed{` is treated as no boxed answer at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rlep.common.answers import extract_answer
from rlep.common.types import Verdict
from rlep.services.verifier.cache import LruCache


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
    score: float | None = None
    """A non-math scorer's score (`rlep.services.verifier.python_scorer`); None for math-verify and failed items."""
    error: str = ""
    """Why a scorer other than math-verify failed (ERROR, TIMEOUT), in one line: the verifier logs it."""


@contextlib.contextmanager
def cpu_time_limit(seconds: float) -> Iterator[None]:
    """Raises math-verify's `TimeoutException` once the process has spent `seconds` of CPU time in the block.

    CPU time, not wall time, so a verdict does not depend on what else the machine runs. Main thread only
    (signal handlers run there). The exception may surface just after the block ends: callers catch it
    around the block, not inside.

    The handler's exception can be lost inside the block: Python drops exceptions raised while it runs a
    finaliser (`__del__`, a weakref callback) and some C paths swallow any exception of a `__hash__`/`__eq__`
    they call. The parse then runs on and finishes past the limit, so the block raises at its end as well:
    once the limit has fired, the block's result is never used.
    """
    from math_verify.errors import TimeoutException

    fired = False

    def expire(signum: int, frame: object) -> None:
        nonlocal fired
        fired = True
        raise TimeoutException(f"over {seconds} s of CPU time")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
    if fired:  # reached only when the block swallowed the handler's exception
        raise TimeoutException(f"over {seconds} s of CPU time (the limit's exception was lost inside the block)")


@dataclass(frozen=True)
class CheckKey:
    """Everything a verdict depends on besides `CheckOptions`: equal keys under equal options get equal verdicts.

    The verdict cache keys on it, so it holds exactly what `check_key` reads, nothing normalised further.
    """

    answer: str
    """The extracted answer, as `extract_answer` returned it (within `max_answer_chars`)."""
    gold: str
    """The gold answer with surrounding whitespace stripped (non-empty, within `max_answer_chars`)."""


class ParseCache:
    """Parsed gold answers and parsed extracted answers by their text, each an LRU of `max_entries`.

    A question's G responses share its gold answer, and common answers ("0", "2") recur across questions,
    so a worker parses each text once. Only finished parses are stored: a parse ended by the CPU-time
    limit or by MemoryError raises and leaves nothing behind.
    """

    def __init__(self, max_entries: int):
        self.gold: LruCache[str, tuple] = LruCache(max_entries)
        self.answers: LruCache[str, tuple] = LruCache(max_entries)


def _parse_gold(gold_text: str, timeout_s: float, cache: ParseCache | None) -> tuple:
    """Parses a gold answer; () when it has no expression at all (e.g. "???"), which cannot be judged.

    math-verify falls back to the raw string when it cannot build an expression, so a string-only
    parse counts as none. Raises math-verify's TimeoutException past the CPU-time limit.
    """
    from math_verify import parse

    if cache is not None and (cached := cache.gold.get(gold_text)) is not None:
        return cached
    result: tuple = ()
    for candidate in (f"${gold_text}$", f"\\boxed{{{gold_text}}}"):
        try:
            with cpu_time_limit(timeout_s):  # parsing_timeout=None: our CPU-time limit replaces its alarm
                parsed = parse(candidate, parsing_timeout=None, raise_on_error=True)
        except MemoryError:
            raise
        except Exception:  # raise_on_error=False would return [] here; it would also swallow the timeout
            parsed = []
        if any(not isinstance(p, str) for p in parsed):
            result = tuple(parsed)
            break
    if cache is not None:
        cache.gold.put(gold_text, result)
    return result


def _parse_answer(answer: str, timeout_s: float, cache: ParseCache | None) -> tuple:
    """Parses an extracted answer; raises on input math-verify cannot read (and past the CPU-time limit)."""
    from math_verify import parse

    if cache is not None and (cached := cache.answers.get(answer)) is not None:
        return cached
    with cpu_time_limit(timeout_s):
        parsed = tuple(parse(f"\\boxed{{{answer}}}", parsing_timeout=None, raise_on_error=True))
    if cache is not None:
        cache.answers.put(answer, parsed)
    return parsed


def prepare_check(response: str, ground_truth: str, options: CheckOptions) -> CheckKey | CheckResult:
    """The cheap part of a check (pure string work, any thread): the key to decide, or the verdict already.

    Returns a `CheckResult` when no parsing is needed (no answer, answer or gold too long, empty gold).
    """
    extracted = extract_answer(response)
    if extracted is None:
        return CheckResult(Verdict.UNPARSEABLE, "")
    if len(extracted) > options.max_answer_chars:
        return CheckResult(Verdict.UNPARSEABLE, extracted[: options.max_answer_chars])
    gold_text = ground_truth.strip()
    if not gold_text or len(gold_text) > options.max_answer_chars:
        return CheckResult(Verdict.GOLD_UNPARSEABLE, extracted)
    return CheckKey(extracted, gold_text)


def _require_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        # The CPU-time limit is a signal handler; elsewhere every check would fail as UNPARSEABLE.
        raise RuntimeError("check_answer must run on a process's main thread (see rlep.services.verifier.pool)")


def check_key(key: CheckKey, options: CheckOptions, cache: ParseCache | None = None) -> CheckResult:
    """Decides a prepared key with math-verify (main thread only). Every outcome is a verdict.

    TIMEOUT (a step over its CPU-time limit) and ERROR (MemoryError under the worker's memory limit)
    depend on the process, not only on the key: callers must not cache them as the key's verdict.
    """
    from math_verify import verify
    from math_verify.errors import TimeoutException

    _require_main_thread()
    started = time.perf_counter()

    def done(verdict: Verdict) -> CheckResult:
        return CheckResult(verdict, key.answer, time.perf_counter() - started)

    try:
        gold = _parse_gold(key.gold, options.parse_timeout_s, cache)
        if not gold:
            return done(Verdict.GOLD_UNPARSEABLE)
        predicted = _parse_answer(key.answer, options.parse_timeout_s, cache)
    except TimeoutException:
        return done(Verdict.TIMEOUT)
    except MemoryError:
        return done(Verdict.ERROR)
    except Exception:  # sympy/antlr fail in many ways on odd input: it is not a parseable answer
        return done(Verdict.UNPARSEABLE)
    if not predicted:
        return done(Verdict.UNPARSEABLE)
    try:
        with cpu_time_limit(options.parse_timeout_s):
            same = verify(list(gold), list(predicted), timeout_seconds=None, raise_on_error=True)
    except TimeoutException:
        return done(Verdict.TIMEOUT)
    except MemoryError:
        return done(Verdict.ERROR)
    except Exception:  # parsed but not comparable (e.g. a matrix against a number): not equivalent
        same = False
    return done(Verdict.CORRECT if same else Verdict.WRONG)


def check_answer(
    response: str, ground_truth: str, options: CheckOptions = CheckOptions(), cache: ParseCache | None = None
) -> CheckResult:
    """Decides one response (main thread only): `prepare_check`, then `check_key`. Every outcome is a verdict.

    Without `cache` every call parses its gold answer afresh, as plain math-verify does.
    """
    _require_main_thread()
    started = time.perf_counter()
    prepared = prepare_check(response, ground_truth, options)
    result = prepared if isinstance(prepared, CheckResult) else check_key(prepared, options, cache)
    return dataclasses.replace(result, seconds=time.perf_counter() - started)


def reward_of(verdict: Verdict, reward_correct: float, reward_wrong: float) -> float:
    return reward_correct if verdict == Verdict.CORRECT else reward_wrong
