"""The protocol's statistics (rlep.experiments.protocol.compare, rlep.common.curves): plateau rule, steps to
reach, AUC, paired bootstrap, evaluation noise, pool coverage and diversity; plus the collection's keep rule."""

from __future__ import annotations

import math
import random

import pytest

from rlep.common.curves import peak, steps_to_reach
from rlep.experiments.protocol.compare import (
    censored_median,
    clustered_standard_error,
    curve_auc,
    paired_bootstrap,
    plateau_step,
    pool_diversity,
    questions_for_standard_error,
)
from rlep.services.learner.collect import keeps_question


def test_plateau_needs_patience_evaluations_without_a_new_best():
    curve = [(0, 0.2), (10, 0.3), (20, 0.35), (30, 0.34), (40, 0.35), (50, 0.33)]
    assert plateau_step(curve, patience=3) == 50  # best 0.35 at step 20; 30, 40 (a tie), 50 bring nothing
    assert plateau_step(curve, patience=4) is None
    assert plateau_step(curve, patience=2) == 40


def test_plateau_ignores_rises_within_min_delta():
    curve = [(0, 0.5), (5, 0.505), (10, 0.509), (15, 0.52)]
    assert plateau_step(curve, patience=2, min_delta=0.01) == 10  # +0.005 and +0.009 are noise
    assert plateau_step(curve, patience=2, min_delta=0.0) is None  # each is a new best without the margin
    # A real rise resets the count: 0.52 beats 0.5 + 0.01, then 0.525 and 0.52 are noise.
    assert plateau_step([(0, 0.5), (5, 0.505), (10, 0.52), (15, 0.525), (20, 0.52)], 2, min_delta=0.01) == 20


def test_plateau_never_on_a_rising_curve():
    assert plateau_step([(s, s / 100) for s in range(0, 100, 5)], patience=1, min_delta=0.01) is None
    with pytest.raises(ValueError):
        plateau_step([(0, 0.1)], patience=0)


def test_peak_and_steps_to_reach_take_the_first_step():
    curve = [(0, 0.1), (5, 0.4), (10, 0.4), (15, 0.3)]
    assert peak(curve) == (5, 0.4)
    assert steps_to_reach(curve, 0.4) == 5
    assert steps_to_reach(curve, 0.35) == 5
    assert steps_to_reach(curve, 0.41) is None
    assert steps_to_reach(curve, 0.0) == 0


def test_censored_median_is_the_sample_median_without_censoring():
    assert censored_median([5, 1, 4, 2, 3], [True] * 5) == 3
    assert censored_median([1, 2, 3, 4], [True] * 4) == 2  # the lower of the two middle values


def test_censored_median_counts_seeds_that_never_reach_it():
    # The protocol's five seeds: three reach the baseline's peak, two never do within their runs.
    ratios, reached = [0.83, 0.87, 1.0, 1.5, 1.6], [True, True, True, False, False]
    assert censored_median(ratios, reached) == 1.0
    # A mean over the seeds that got there says 1.0 here; most seeds never did, so there is no median.
    assert censored_median([1.0, 5.0, 6.0, 7.0], [True, False, False, False]) is None
    # A seed censored early leaves the risk set, so later events weigh more: 1 of 3, then 2 of 3 gone.
    assert censored_median([0.5, 1.0, 2.0, 3.0], [False, True, True, True]) == 2.0
    # At equal times the event counts first (the censored seed was still watched when it happened).
    assert censored_median([2.0, 2.0, 3.0], [True, False, True]) == 3.0


def test_censored_median_checks_its_input():
    with pytest.raises(ValueError):
        censored_median([], [])
    with pytest.raises(ValueError):
        censored_median([1.0], [True, False])


def test_auc_is_the_trapezoid_mean_over_the_span():
    assert curve_auc([(0, 0.0), (10, 1.0)]) == pytest.approx(0.5)
    assert curve_auc([(0, 0.2), (10, 0.4), (30, 0.4)]) == pytest.approx((10 * 0.3 + 20 * 0.4) / 30)
    # Cut at a common step so that runs of different lengths compare over the same steps.
    assert curve_auc([(0, 0.0), (10, 1.0), (20, 0.0)], until=10) == pytest.approx(0.5)
    assert curve_auc([(0, 0.3)]) == 0.3
    with pytest.raises(ValueError):
        curve_auc([(0, 0.1), (10, 0.2)], until=5)


def test_paired_bootstrap_centres_on_the_mean_difference_and_covers_it():
    rng = random.Random(1)
    control = [rng.uniform(0.3, 0.6) for _ in range(8)]
    treated = [c + 0.05 + rng.gauss(0, 0.01) for c in control]
    ci = paired_bootstrap(treated, control, resamples=4000, seed=3)
    assert ci.mean == pytest.approx(sum(t - c for t, c in zip(treated, control, strict=True)) / 8)
    assert ci.low < ci.mean < ci.high
    assert ci.low > 0.03 and ci.high < 0.07  # paired: the big between-seed spread cancels
    assert ci.excludes_zero() and ci.n == 8


def test_paired_bootstrap_interval_straddles_zero_without_an_effect():
    control = [0.40, 0.55, 0.47, 0.61, 0.52]
    treated = [0.42, 0.53, 0.48, 0.60, 0.53]  # differences +-0.02 around 0
    ci = paired_bootstrap(treated, control, seed=0)
    assert ci.low < 0 < ci.high and not ci.excludes_zero()


def test_paired_bootstrap_is_deterministic_and_checks_its_input():
    a, b = [1.0, 2.0, 4.0], [0.0, 1.0, 1.0]
    assert paired_bootstrap(a, b, seed=7) == paired_bootstrap(a, b, seed=7)
    one = paired_bootstrap([0.5], [0.25])
    assert (one.mean, one.low, one.high, one.n) == (0.25, 0.25, 0.25, 1) and not one.excludes_zero()
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 2.0])


def test_clustered_standard_error_counts_questions_not_samples():
    # Every question is all right or all wrong: 4 samples each add nothing, SE is that of 4 questions.
    correlated = [[True] * 4, [False] * 4, [True] * 4, [False] * 4]
    assert clustered_standard_error(correlated) == pytest.approx(math.sqrt(1 / 3 / 4))
    # Same accuracy with no difference between questions: no between-question variance.
    assert clustered_standard_error([[True, False]] * 4) == 0.0


def test_questions_for_standard_error():
    assert questions_for_standard_error(0.01) == 2500
    assert questions_for_standard_error(0.01, accuracy=0.8) == 1600
    assert math.sqrt(0.25 / questions_for_standard_error(0.013)) <= 0.013


def test_pool_diversity_counts_coverage_successes_and_paths():
    successes = {
        "q1": ["1+2=3, 3+4=7 \\boxed{7}", "1+4=5, 5+2=7 \\boxed{7}", "1+2=3,3+4=7 \\boxed{7}"],
        "q2": ["5+5=10 \\boxed{10}", "5+5=10 \\boxed{10}"],  # one text stored twice counts once
        "q9": ["not a training question"],
    }
    path_of = lambda qid, text: text.replace(" ", "")  # noqa: E731 - spacing is not a path
    d = pool_diversity(successes, ["q1", "q2", "q3", "q4"], path_of)
    assert d.coverage == 0.5 and d.questions == 2
    assert d.successes_per_question == pytest.approx((3 + 1) / 2)
    assert d.paths_per_question == pytest.approx((2 + 1) / 2)
    assert d.multi_path_share == 0.5
    assert pool_diversity({}, ["q1"], path_of).coverage == 0.0


def test_keep_rule_counts_correct_samples_or_distinct_texts():
    same_twice = ["a \\boxed{1}", "a \\boxed{1}"]
    assert keeps_question(same_twice, 2, "correct") and not keeps_question(same_twice, 2, "distinct")
    assert keeps_question(["a", "b"], 2, "distinct")
    assert not keeps_question(["a"], 2, "correct")
    assert not keeps_question([], 1)
