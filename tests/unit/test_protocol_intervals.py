"""The protocol's interval arithmetic (rlep.experiments.protocol.intervals) against scipy: Student t quantiles and
CDF, the paired t interval and p, the bootstrap shown beside it, Holm's correction.

scipy is no dependency of the package. The reference values below were printed by scipy 1.17.1 (`stats.t.ppf`,
`stats.t.cdf`, `stats.ttest_rel(...).confidence_interval(level)`, `.pvalue`) on the fixed data shown; where scipy
is installed, `test_matches_scipy_live` compares against it directly on a wider grid."""

from __future__ import annotations

import math
import random

import pytest

from rlep.experiments.protocol.intervals import (
    T_PRIMARY_MAX_N,
    both_intervals,
    holm,
    paired_t,
    paired_t_p_value,
    t_cdf,
    t_quantile,
)

# (df, p, scipy.stats.t.ppf(p, df))
SCIPY_PPF = [
    (1, 0.975, 12.706204736174694),
    (2, 0.975, 4.302652729749462),
    (4, 0.975, 2.7764451051977934),
    (4, 0.995, 4.604094871349992),
    (9, 0.95, 1.833112932656237),
    (30, 0.975, 2.0422724563012378),
    (2, 0.9995, 31.599054576445365),
]
# (df, t, scipy.stats.t.cdf(t, df))
SCIPY_CDF = [(1, -3.0, 0.10241638234956672), (4, 0.5, 0.6783350184090684), (9, -40.0, 9.491499224669911e-12)]


@pytest.mark.parametrize(("df", "p", "expected"), SCIPY_PPF)
def test_t_quantiles_match_scipy(df, p, expected):
    assert t_quantile(p, df) == pytest.approx(expected, rel=1e-10)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, rel=1e-10)  # symmetric


@pytest.mark.parametrize(("df", "t", "expected"), SCIPY_CDF)
def test_t_cdf_matches_scipy(df, t, expected):
    assert t_cdf(t, df) == pytest.approx(expected, rel=1e-10)


def test_the_paired_t_interval_and_p_match_scipy_on_fixed_data():
    # Three seeds' peaks, RLEP against baseline: scipy.stats.ttest_rel(treated, control).
    treated, control = [0.551, 0.577, 0.558], [0.530, 0.554, 0.555]
    ci = paired_t(treated, control)
    assert (ci.mean, ci.low, ci.high, ci.n) == pytest.approx(
        (0.015666666666666645, -0.011696460726610906, 0.0430297940599442, 3), rel=1e-9
    )
    assert paired_t_p_value(treated, control) == pytest.approx(0.13274685253327356, rel=1e-9)
    five = [0.1, 0.25, -0.05, 0.3, 0.12]
    at90 = paired_t(five, [0.0] * 5, level=0.90)
    assert (at90.low, at90.high) == pytest.approx((0.012826443414361788, 0.27517355658563813), rel=1e-9)
    assert paired_t_p_value(five, [0.0] * 5) == pytest.approx(0.07935200559751947, rel=1e-9)


def test_matches_scipy_live():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(7)
    for df in (1, 2, 3, 4, 6, 9, 15, 40, 200):
        for p in (0.6, 0.9, 0.95, 0.975, 0.99, 0.999, 0.02):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)
    for n in (2, 3, 5, 8, 10):
        treated = [rng.gauss(0.02, 0.01) for _ in range(n)]
        control = [rng.gauss(0.0, 0.01) for _ in range(n)]
        reference = stats.ttest_rel(treated, control)
        ci = paired_t(treated, control)
        assert (ci.low, ci.high) == pytest.approx(tuple(reference.confidence_interval(0.95)), rel=1e-9)
        assert paired_t_p_value(treated, control) == pytest.approx(reference.pvalue, rel=1e-9)


def test_t_is_primary_up_to_ten_pairs_with_the_bootstrap_beside_it():
    few = both_intervals([0.551, 0.577, 0.558], [0.530, 0.554, 0.555])
    assert few["method"] == "t" and (few["low"], few["high"]) == (few["t_low"], few["t_high"])
    # Three seeds: the bootstrap cannot see past the three differences (0.003 to 0.023), the t interval can.
    assert few["t_low"] < few["boot_low"] <= few["boot_high"] < few["t_high"]
    assert few["boot_low"] >= 0.003 - 1e-12 and few["boot_high"] <= 0.023 + 1e-12
    rng = random.Random(1)
    many = [rng.gauss(0.01, 0.02) for _ in range(T_PRIMARY_MAX_N + 1)]
    above = both_intervals(many, [0.0] * len(many))
    assert above["method"] == "bootstrap" and (above["low"], above["high"]) == (above["boot_low"], above["boot_high"])
    assert both_intervals(many[:T_PRIMARY_MAX_N], [0.0] * T_PRIMARY_MAX_N)["method"] == "t"


def test_one_pair_gives_a_difference_and_no_interval_or_p():
    one = paired_t([0.6], [0.5])
    assert one.n == 1 and one.low == one.high == pytest.approx(0.1)
    assert paired_t_p_value([0.6], [0.5]) is None
    assert paired_t_p_value([0.6, 0.7], [0.5, 0.6]) == 0.0  # identical non-zero differences: no spread
    assert paired_t_p_value([0.5, 0.6], [0.5, 0.6]) == 1.0


def test_holm_multiplies_the_ith_smallest_p_by_m_minus_i_plus_1_and_keeps_the_order():
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    # a: 3 x 0.01; c: 2 x 0.03; b: 1 x 0.04 = 0.04, raised to c's 0.06 (an adjusted p never falls with p).
    assert adjusted == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert holm({"a": 0.5, "b": 0.6})["a"] == 1.0  # capped
    assert holm({}) == {}


@pytest.mark.parametrize(
    "call",
    [
        lambda: t_quantile(0.0, 3),
        lambda: t_quantile(1.0, 3),
        lambda: t_quantile(0.9, 0),
        lambda: t_cdf(1.0, -1),
        lambda: paired_t([0.1, 0.2], [0.1]),
        lambda: paired_t([], []),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(call):
    with pytest.raises(ValueError):
        call()


def test_extreme_quantiles_stay_finite_and_ordered():
    # A 99.99% interval over 2 pairs (df = 1): t ~ 6,366; the search must bracket it, not loop or overflow.
    q = t_quantile(0.99995, 1)
    assert q == pytest.approx(1 / math.tan(math.pi * 0.00005), rel=1e-9)  # Cauchy: t = cot(pi x tail)
    assert t_quantile(0.975, 1) < q


def test_the_reports_paired_rows_lead_with_the_t_interval_and_star_by_it():
    """Three seeds whose bootstrap excludes 0 and whose t interval does not: the row must not read as a finding."""
    from rlep.experiments.protocol import figures, report

    row = figures._interval([0.530, 0.554, 0.555], [0.551, 0.577, 0.558])  # baseline, RLEP
    assert (row["low"], row["high"]) == pytest.approx((-0.011696460726610906, 0.0430297940599442), rel=1e-9)
    assert row["boot_low"] > 0 and not row["excludes_zero"]
    assert report._ci(row) == f"+0.016 t[-0.012, +0.043] boot({row['boot_low']:+.3f}, {row['boot_high']:+.3f})"
