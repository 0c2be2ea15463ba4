"""Eval's figures: the majority vote, and Avg@N / Maj@N / Pass@N over a dataset (pure: no service around them).

Per question, N responses are sampled and each gets a verdict from the verifier. Over a dataset:
- Avg@N: the mean accuracy over all samples (the paper's headline metric: mean@N).
- Maj@N: the share of questions whose most frequent extracted answer is correct. Answers are grouped
  after a light normalisation (`normalize_answer`: spacing, `\\left`/`\\right`, `\\dfrac`, `27.0` -> `27`,
  ...), not by symbolic equivalence, so two equivalent spellings split their votes and Maj@N can read a
  little low. Unparseable answers do not vote; ties go to the answer seen first.
- Pass@N: the share of questions with at least one correct sample.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlep.common.types import Verdict

_VOTE_DROPPED = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$|\s+|\^\{?\\circ\}?")
_INTEGRAL_DECIMAL = re.compile(r"^(-?\d+)\.0+$")


def normalize_answer(answer: str) -> str:
    """The key answers are grouped by for the majority vote (equal keys vote together)."""
    key = _VOTE_DROPPED.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")
    return _INTEGRAL_DECIMAL.sub(r"\1", key)


def majority_answer(answers: Sequence[str]) -> str | None:
    """The most frequent normalized non-empty answer (ties: the one seen first), or None if there is none."""
    keys = [normalize_answer(a) for a in answers]
    counts = Counter(k for k in keys if k)
    return counts.most_common(1)[0][0] if counts else None


@dataclass(frozen=True)
class SampleScore:
    """One response as eval sees it: the verifier's verdict and answer, and its length."""

    verdict: Verdict
    extracted_answer: str
    response_tokens: int
    truncated: bool  # stopped by max_tokens


@dataclass(frozen=True)
class QuestionScore:
    samples: int
    correct: int
    majority_correct: bool
    response_tokens: int
    unparseable: int
    truncated: int
    verdicts: dict[str, int]


def score_question(samples: Sequence[SampleScore]) -> QuestionScore:
    """Scores one question's N samples. The voted answer is correct when the verifier judged a sample
    carrying it CORRECT (samples with the same answer share a verdict)."""
    if not samples:
        raise ValueError("a question needs at least one sample")
    voters = [s for s in samples if s.verdict != Verdict.UNPARSEABLE and s.extracted_answer]
    winner = majority_answer([s.extracted_answer for s in voters])
    majority_correct = winner is not None and any(
        s.verdict == Verdict.CORRECT for s in voters if normalize_answer(s.extracted_answer) == winner
    )
    return QuestionScore(
        samples=len(samples),
        correct=sum(s.verdict == Verdict.CORRECT for s in samples),
        majority_correct=majority_correct,
        response_tokens=sum(s.response_tokens for s in samples),
        unparseable=sum(s.verdict == Verdict.UNPARSEABLE for s in samples),
        truncated=sum(s.truncated for s in samples),
        verdicts=dict(Counter(str(s.verdict) for s in samples)),
    )


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


@dataclass
class DatasetTally:
    """Running sums over the questions of one dataset scored so far (stored with a job's progress)."""

    questions: int = 0
    samples: int = 0
    correct: int = 0
    majority_correct: int = 0
    any_correct: int = 0
    response_tokens: int = 0
    unparseable: int = 0
    truncated: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)

    def add(self, score: QuestionScore) -> None:
        self.questions += 1
        self.samples += score.samples
        self.correct += score.correct
        self.majority_correct += score.majority_correct
        self.any_correct += score.correct > 0
        self.response_tokens += score.response_tokens
        self.unparseable += score.unparseable
        self.truncated += score.truncated
        for verdict, count in score.verdicts.items():
            self.verdicts[verdict] = self.verdicts.get(verdict, 0) + count

    def summary(self) -> dict[str, Any]:
        """Avg@N, Maj@N, Pass@N and mean response length (None until a question is scored), plus the counts."""
        return {
            **asdict(self),
            "avg_at_n": _ratio(self.correct, self.samples),
            "maj_at_n": _ratio(self.majority_correct, self.questions),
            "pass_at_n": _ratio(self.any_correct, self.questions),
            "mean_response_tokens": _ratio(self.response_tokens, self.samples),
        }
