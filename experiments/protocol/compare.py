"""Statistics that compare the protocol's training runs by their held-out accuracy curves (`run`, `report`).

Pure functions over plain lists, no engines: a curve is `[(step, accuracy), ...]` in step order, as the
learner's periodic evaluation logs it (step 0 = the starting weights). One curve's `peak` and `steps_to_reach`,
which the demo shares, are in `rlep.common.curves`.

- `plateau_step`: early-stopping rule: a run has plateaued once `patience` evaluations in a row brought
  no new best by more than `min_delta` (one standard error of an evaluation is a good `min_delta`: a
  smaller rise is within the evaluation's noise).
- `curve_auc`: the mean accuracy over the run (area under the curve / span).
- `paired_bootstrap`: mean of per-seed differences with a percentile bootstrap interval over seeds.
- `censored_median`: the Kaplan-Meier median of a time-to-event figure (steps to the baseline's peak) where
  some seeds never get there: a mean over the seeds that do would flatter the arm.
- `clustered_standard_error`, `questions_for_standard_error`: the noise of one evaluation when several
  samples of one question are scored (they are correlated, so the question is the unit).
- `pool_diversity`: coverage of a replay pool (share of training questions it can replay) and how many
  distinct successes and solution paths it holds per question.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rlep.common.curves import Curve


def plateau_step(curve: Curve, patience: int, min_delta: float = 0.0) -> int | None:
    """The step of the evaluation at which the run counts as plateaued; None while it has not.

    Walks the curve keeping the best accuracy; an evaluation above best + `min_delta` is a new best,
    any other adds one to a counter that a new best resets. The run plateaus at the evaluation where
    the counter reaches `patience`.
    """
    if patience < 1:
        raise ValueError("patience must be >= 1")
    best, since = -math.inf, 0
    for step, accuracy in curve:
        if accuracy > best + min_delta:
            best, since = accuracy, 0
        else:
            since += 1
            if since >= patience:
                return step
    return None


def curve_auc(curve: Curve, until: int | None = None) -> float:
    """Mean accuracy over steps [first, until] (trapezoids between evaluations, divided by the span).

    `until` (default: the curve's last step) cuts the curve so that runs of different lengths compare
    over the same steps; it must be one of the curve's steps. A one-point curve returns its value.
    """
    points = [(s, a) for s, a in curve if until is None or s <= until]
    if not points:
        raise ValueError("no evaluation at or before `until`")
    if until is not None and points[-1][0] != until:
        raise ValueError(f"the curve has no evaluation at step {until}")
    span = points[-1][0] - points[0][0]
    if span == 0:
        return points[0][1]
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(points, points[1:], strict=False))
    return area / span


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    """How many pairs (seeds) it rests on."""

    def excludes_zero(self) -> bool:
        return self.n > 1 and (self.low > 0 or self.high < 0)


def paired_bootstrap(
    treated: Sequence[float], control: Sequence[float], resamples: int = 10_000, seed: int = 0, level: float = 0.95
) -> Interval:
    """Mean of `treated[i] - control[i]` over pairs (seeds) and its percentile bootstrap interval.

    Pairs are resampled with replacement, each resample's mean difference is kept, and the interval is
    the (1-level)/2 and (1+level)/2 quantiles of those means. With one pair the interval is that pair.
    """
    if len(treated) != len(control) or not treated:
        raise ValueError("need the same, non-zero number of treated and control values")
    diffs = [t - c for t, c in zip(treated, control, strict=True)]
    mean = sum(diffs) / len(diffs)
    if len(diffs) == 1:
        return Interval(mean, mean, mean, 1)
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    low_index = int(math.floor((1 - level) / 2 * (resamples - 1)))
    high_index = int(math.ceil((1 + level) / 2 * (resamples - 1)))
    return Interval(mean, means[low_index], means[high_index], n)


def censored_median(times: Sequence[float], reached: Sequence[bool]) -> float | None:
    """Kaplan-Meier median of times to an event, where `reached[i]` False means seed i was watched until
    `times[i]` without the event (right-censored: its time is at least that).

    The survival estimate S(t) (share of seeds that have not yet reached it) steps down at each event by
    the share of seeds still watched then; the median is the first event time where S <= 0.5. None when
    S never falls to 0.5 (too many seeds never reached it: the median lies beyond the watched times).
    At equal times events count before censorings, as is the convention.
    """
    if len(times) != len(reached) or not times:
        raise ValueError("need the same, non-zero number of times and reached flags")
    order = sorted(zip(times, reached, strict=True), key=lambda pair: (pair[0], not pair[1]))
    survival, at_risk = 1.0, len(order)
    for time, event in order:
        if event:
            survival *= 1 - 1 / at_risk
            if survival <= 0.5 + 1e-12:
                return time
        at_risk -= 1
    return None


def clustered_standard_error(per_question: Sequence[Sequence[bool]]) -> float:
    """Standard error of an evaluation's accuracy with questions as the sampling unit.

    Accuracy = mean over questions of each question's success rate (equal samples per question), so
    its variance is the between-question variance of those rates over the number of questions. This
    counts the correlation of one question's samples, which a binomial formula over all samples ignores.
    """
    rates = [sum(outcomes) / len(outcomes) for outcomes in per_question if outcomes]
    q = len(rates)
    if q < 2:
        raise ValueError("need at least two questions")
    mean = sum(rates) / q
    return math.sqrt(sum((r - mean) ** 2 for r in rates) / (q - 1) / q)


def questions_for_standard_error(target: float, accuracy: float = 0.5) -> int:
    """Questions needed, one sample each, so that one evaluation's standard error is at most `target`.

    One sample per question makes the samples independent Bernoulli(p) draws: SE = sqrt(p(1-p)/Q).
    p = 0.5 is the worst case; with k > 1 samples per question the SE is at most this bound with Q
    questions (k samples can only lower the within-question part), so Q from here suffices for any k.
    """
    if not 0 < target < 1:
        raise ValueError("target must be in (0, 1)")
    return math.ceil(accuracy * (1 - accuracy) / target**2)


@dataclass(frozen=True)
class PoolDiversity:
    coverage: float
    """Share of the training questions with at least one replayable success in the pool."""
    questions: int
    """Training questions in the pool."""
    successes_per_question: float
    """Mean distinct stored successes per pooled question."""
    paths_per_question: float
    """Mean distinct valid solution paths per pooled question (responses mapped by `path_of`)."""
    multi_path_share: float
    """Share of pooled questions holding at least two distinct solution paths."""


def pool_diversity(
    successes: Mapping[str, Sequence[str]], train_questions: Sequence[str], path_of: Callable[[str, str], str]
) -> PoolDiversity:
    """Coverage and diversity of a pool given as question id -> stored success texts.

    `path_of(question_id, text)` names the solution path a success takes (e.g. the canonical worked
    solution it matches); texts that differ only in ways the path ignores count as one path.
    Questions outside `train_questions` are ignored.
    """
    train = set(train_questions)
    if not train:
        raise ValueError("no training questions")
    pooled = {qid: set(texts) for qid, texts in successes.items() if qid in train and texts}
    if not pooled:
        return PoolDiversity(0.0, 0, 0.0, 0.0, 0.0)
    paths = {qid: {path_of(qid, t) for t in texts} for qid, texts in pooled.items()}
    n = len(pooled)
    return PoolDiversity(
        coverage=n / len(train),
        questions=n,
        successes_per_question=sum(len(t) for t in pooled.values()) / n,
        paths_per_question=sum(len(p) for p in paths.values()) / n,
        multi_path_share=sum(len(p) >= 2 for p in paths.values()) / n,
    )
