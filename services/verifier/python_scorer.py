"""Scorers other than math-verify: a score per item, and what it means for the verdict.

A scorer returns a finite number or a dict with a finite `score` (and optionally an `extracted_answer` string),
like verl's `compute_score` functions. `score_of` checks that shape; anything else (a bool, NaN, inf, a missing
score, an exception) is the scorer's failure and the item's verdict is ERROR, never a number we made up. A score
at or above the scorer's `success_threshold` is CORRECT, else WRONG: the learner's success rule (replay pool,
dynamic sampling's `acc`, eval accuracy) stays "verdict is CORRECT" for every scorer.

`run_score_call` runs a user's Python function in a verifier worker process, on its main thread, under the same
limits as a math-verify step: `parse_timeout_s` of CPU time (TIMEOUT past it), the worker's memory limit (ERROR),
and the pool's wall-clock kill (TIMEOUT, worker replaced). It does not sandbox the function: it runs with the
verifier's permissions, so configure only code you trust.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlep.common.strict_json import strict_loads
from rlep.common.types import Verdict
from rlep.services.verifier.judge import CheckOptions, CheckResult, cpu_time_limit

if TYPE_CHECKING:
    from rlep.services.verifier.config import ScorerSettings

ScoreFunction = Callable[[str, str, dict], Any]


@dataclass(frozen=True)
class ScoreCall:
    """One item for a Python scorer, as sent to a worker process (picklable, hashable)."""

    function: str
    """`module:function`."""
    response: str
    ground_truth: str
    extra: str
    """A JSON object's text ("" = {}), checked by the server before it is sent."""
    success_threshold: float


def load_function(path: str) -> ScoreFunction:
    """The callable named by `module:function`, checked to take `(response, ground_truth, extra)`; ValueError
    saying what is wrong (in one line: the module's own traceback stays out of it) when there is none."""
    module_name, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except Exception as err:  # ImportError, AttributeError, and whatever the module raises as it is imported
        hint = "; put the folder holding it in scorer_path" if isinstance(err, ModuleNotFoundError) else ""
        raise ValueError(f"scorer function {path!r} cannot be loaded: {type(err).__name__}: {err}{hint}") from None
    if not callable(function):
        raise ValueError(f"scorer function {path!r} is not callable")
    try:
        inspect.signature(function).bind("response", "ground truth", {})
    except TypeError as err:
        raise ValueError(f"scorer function {path!r} must take (response, ground_truth, extra): {err}") from None
    except ValueError:  # a builtin without a signature to read: called as it is
        pass
    return function


def use_scorer_path(folders: Iterable[Path]) -> None:
    """Puts `folders` first on this process's module search path, and so on that of the worker processes it
    starts afterwards (each gets the parent's sys.path at its start). ValueError naming a folder that does not
    exist."""
    folders = list(folders)
    for folder in folders:
        if not folder.is_dir():
            raise ValueError(f"scorer_path: {folder} is not a folder")
    for folder in reversed(folders):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


def check_scorers(settings: ScorerSettings) -> None:
    """Imports every Python scorer of `settings` here, its `scorer_path` first on sys.path, and checks each takes
    (response, ground_truth, extra): a start refused in one line instead of a verifier failing minutes later."""
    use_scorer_path(settings.scorer_path)
    for spec in [*settings.scorers.values(), settings.default_scorer]:
        if spec.type == "python":
            load_function(spec.function)


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception as one bounded line for a log: its type and message, no traceback."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_extra(text: str) -> dict:
    """An item's `extra` as a dict; ValueError unless it is empty or strict JSON for an object."""
    if not text:
        return {}
    value = strict_loads(text)
    if not isinstance(value, dict):
        raise ValueError("extra must be a JSON object")
    return value


def score_of(value: Any, max_answer_chars: int) -> tuple[float, str]:
    """(score, extracted answer) of what a scorer returned; ValueError unless it is a finite number or a dict
    with one under `score` (and, optionally, a string `extracted_answer`, cut to `max_answer_chars`)."""
    extracted = ""
    if isinstance(value, dict):
        extracted = value.get("extracted_answer", "")
        if not isinstance(extracted, str):
            raise ValueError("extracted_answer must be a string")
        if "score" not in value:
            raise ValueError("a dict result needs a 'score'")
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"score must be a number, not {type(value).__name__}")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"score must be finite, not {score}")
    return score, extracted[:max_answer_chars]


def verdict_of(score: float, success_threshold: float) -> Verdict:
    return Verdict.CORRECT if score >= success_threshold else Verdict.WRONG


def run_score_call(
    call: ScoreCall, options: CheckOptions, functions: dict[str, ScoreFunction] | None = None
) -> CheckResult:
    """Scores one item with its Python function (main thread only); every outcome is a verdict.

    Args:
        functions: loaded functions by path, kept by the worker so each is imported once.
    """
    from math_verify.errors import TimeoutException  # what `cpu_time_limit` raises

    started = time.perf_counter()
    functions = {} if functions is None else functions
    try:
        if call.function not in functions:
            functions[call.function] = load_function(call.function)
        function = functions[call.function]
        extra = parse_extra(call.extra)
        with cpu_time_limit(options.parse_timeout_s):
            value = function(call.response, call.ground_truth, extra)
        score, extracted = score_of(value, options.max_answer_chars)
    except TimeoutException:
        seconds = time.perf_counter() - started
        return CheckResult(Verdict.TIMEOUT, "", seconds, error=f"over {options.parse_timeout_s:g} s of CPU time")
    except Exception as err:  # the scorer raised, returned a bad value, or ran out of memory (MemoryError)
        return CheckResult(Verdict.ERROR, "", time.perf_counter() - started, error=one_line(err))
    return CheckResult(verdict_of(score, call.success_threshold), extracted, time.perf_counter() - started, score)
