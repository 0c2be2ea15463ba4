"""Verifier logic: pull the final answer out of a response and decide it against the gold answer.

Answer extraction follows the RLEP/DAPO conventions: the last `\\boxed{...}` (or `\\fbox{...}`) with
balanced braces; failing that, the last "Answer: X" line (DAPO-Math's prompt format). Equivalence
is decided by HF math-verify (symbolic and numeric comparison through sympy).

`check_answer` must run on a process's main thread: math-verify's own timeouts use `signal.alarm`.
The service runs it in worker processes (`services.verifier.pool`) and adds a hard per-item timeout
on top, because a pathological input can block inside C code where no signal is delivered.

What is not covered: answers that are only stated in prose ("the answer is seven"), multiple-choice
letter matching beyond what math-verify does, and responses with several conflicting boxed answers
(only the last counts). An unbalanced last `\\boxed{` is treated as no boxed answer at all.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass

from rlep_common.types import Verdict

BOXED_MARKERS = ("\\boxed", "\\fbox")
# DAPO-Math asks for a last line "Answer: $Answer"; verl's math_dapo reads it the same way.
# Markdown emphasis around it ("**Answer:** 9") is common in chat models' output and tolerated.
ANSWER_LINE = re.compile(r"(?im)^[ \t*#]*answer[ \t*]*:[ \t*]*(\S[^\n]*)$")


@dataclass(frozen=True)
class CheckOptions:
    """Limits of one check; picklable so it can be sent to worker processes."""

    max_answer_chars: int = 512
    """Longer extracted answers are UNPARSEABLE without parsing (real answers are short)."""
    parse_timeout_s: int = 1
    """math-verify's own timeout for each parse and for the comparison (whole seconds: signal.alarm)."""


@dataclass(frozen=True)
class CheckResult:
    verdict: Verdict
    extracted_answer: str
    seconds: float = 0.0


def _balanced_group(text: str, open_index: int) -> str | None:
    """Content of the `{...}` group opening at `open_index`, or None when it never closes."""
    depth = 0
    for i in range(open_index, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}`; also `\\boxed 5`. None if absent."""
    start = max(text.rfind(marker) for marker in BOXED_MARKERS)
    if start < 0:
        return None
    marker = next(m for m in BOXED_MARKERS if text.startswith(m, start))
    rest = start + len(marker)
    if text.startswith("{", rest):
        return _balanced_group(text, rest)
    if text.startswith(" ", rest):  # `\boxed 5`: the token after the space
        token = text[rest + 1 :].split(maxsplit=1)
        return token[0].rstrip("$.") if token else None
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: last boxed group, else last "Answer:" line. None if neither."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed.strip()
    matches = ANSWER_LINE.findall(response)
    if not matches:
        return None
    answer = matches[-1].strip().rstrip("*").strip()
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    return answer or None


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str, timeout_s: int) -> tuple:
    """Parses a gold answer; cached because every one of a question's G responses shares it.

    math-verify falls back to the raw string when it cannot build an expression; a gold answer
    with no expression at all (e.g. "???") cannot be judged, so it comes back empty.
    """
    from math_verify import parse

    for candidate in (f"${ground_truth}$", f"\\boxed{{{ground_truth}}}"):
        parsed = parse(candidate, parsing_timeout=timeout_s)
        if any(not isinstance(p, str) for p in parsed):
            return tuple(parsed)
    return ()


def check_answer(response: str, ground_truth: str, options: CheckOptions = CheckOptions()) -> CheckResult:
    """Decides one response. Never raises for bad input: every outcome is a verdict."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

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
        predicted = parse(f"\\boxed{{{extracted}}}", parsing_timeout=options.parse_timeout_s, raise_on_error=True)
    except TimeoutException:
        return done(Verdict.TIMEOUT, extracted)
    except Exception:  # sympy/antlr fail in many ways on odd input: it is not a parseable answer
        return done(Verdict.UNPARSEABLE, extracted)
    if not predicted:
        return done(Verdict.UNPARSEABLE, extracted)
    try:
        same = verify(list(gold), predicted, timeout_seconds=options.parse_timeout_s, raise_on_error=True)
    except TimeoutException:
        return done(Verdict.TIMEOUT, extracted)
    except Exception:  # parsed but not comparable (e.g. a matrix against a number): not equivalent
        same = False
    return done(Verdict.CORRECT if same else Verdict.WRONG, extracted)


def reward_of(verdict: Verdict, reward_correct: float, reward_wrong: float) -> float:
    return reward_correct if verdict == Verdict.CORRECT else reward_wrong
