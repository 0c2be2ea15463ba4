"""Intervals and tests for paired per-seed differences (`figures`, `endpoints`): Student t with df = n - 1, the
percentile bootstrap beside it, and Holm's correction across exploratory cells.

Why t first: a percentile bootstrap over 3-5 seeds under-covers (simulated, a nominal 95% interval covered ~85% of
the time at n = 5 and ~76% at n = 3; issue 49), because resampling 3-5 values cannot see past their range. The t
interval widens by the t quantile instead. So for n <= `T_PRIMARY_MAX_N` the t interval is primary and the
bootstrap is shown beside it; above that the two agree closely and the bootstrap stays primary.

The t distribution is computed here (its CDF through the regularized incomplete beta function, its quantile by
bisection) so that the package needs no scipy; tests/unit/test_protocol_intervals.py checks it against scipy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from rlep.experiments.protocol.compare import Interval, paired_bootstrap

T_PRIMARY_MAX_N = 10
"""Up to this many pairs the t interval is the primary one (see the module docstring)."""
_EPS = 1e-15
_MAX_TERMS = 400  # the continued fraction converges in O(sqrt(max(a, b))) terms; df <= 10^4 needs far fewer


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b) by the modified Lentz method (Numerical Recipes, betacf)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, _MAX_TERMS + 1):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta did not converge for x={x}, a={a}, b={b}")


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for x in [0, 1] and a, b > 0."""
    if not 0.0 <= x <= 1.0 or a <= 0 or b <= 0:
        raise ValueError("need x in [0, 1] and a, b > 0")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # The fraction converges fast only below (a + 1) / (a + b + 2); above it, use I_x(a, b) = 1 - I_{1-x}(b, a).
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_continued_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(1.0 - x, b, a) / b


def _upper_tail(t: float, df: float) -> float:
    """P(T > t) for t >= 0, each way accurate where it is used: no 1 - x where x is near 1."""
    if t * t < df:  # near the centre, P(|T| < t) directly
        return 0.5 - 0.5 * regularized_beta(t * t / (df + t * t), 0.5, df / 2)
    return 0.5 * regularized_beta(df / (df + t * t), df / 2, 0.5)


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError("df must be > 0")
    return 1.0 - _upper_tail(t, df) if t > 0 else _upper_tail(-t, df)


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (Student's t, `df` degrees of freedom), to ~1e-12 relative."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must be in (0, 1)")
    if df <= 0:
        raise ValueError("df must be > 0")
    if p == 0.5:
        return 0.0
    tail = min(p, 1.0 - p)  # solved on the upper tail, which keeps its precision far out
    low, high = 0.0, 1.0
    while _upper_tail(high, df) > tail:  # the tail falls monotonically: double until the quantile is bracketed
        low, high = high, high * 2
    while high - low > 1e-13 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if _upper_tail(middle, df) > tail else (low, middle)
    t = (low + high) / 2
    return t if p > 0.5 else -t


def paired_t(treated: Sequence[float], control: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of `treated[i] - control[i]` over pairs and its Student t interval (df = n - 1).

    mean +- t_{(1+level)/2, n-1} x sd / sqrt(n), sd the sample standard deviation of the differences. With one pair
    the interval is that pair (no spread to scale by).
    """
    diffs = _diffs(treated, control)
    mean = statistics.fmean(diffs)
    if len(diffs) == 1:
        return Interval(mean, mean, mean, 1)
    half = t_quantile((1 + level) / 2, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return Interval(mean, mean - half, mean + half, len(diffs))


def paired_t_p_value(treated: Sequence[float], control: Sequence[float]) -> float | None:
    """Two-sided p of the paired t test of a zero mean difference; None with one pair. Differences with no
    spread give 0 (all alike and non-zero) or 1 (all zero)."""
    diffs = _diffs(treated, control)
    if len(diffs) < 2:
        return None
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = mean / (sd / math.sqrt(len(diffs)))
    return 2 * (1 - t_cdf(abs(t), len(diffs) - 1))


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values: the i-th smallest p times (m - i + 1), made monotone, capped at 1.

    A hypothesis is rejected at family-wise level alpha when its adjusted p <= alpha.
    """
    order = sorted(p_values, key=lambda name: p_values[name])
    m, running, out = len(order), 0.0, {}
    for i, name in enumerate(order):
        running = max(running, min(1.0, (m - i) * p_values[name]))
        out[name] = running
    return out


def both_intervals(treated: Sequence[float], control: Sequence[float], level: float = 0.95) -> dict:
    """The paired mean difference with its t interval and its percentile bootstrap, and which is primary.

    Returns diff, low/high (the primary interval), method ("t" or "bootstrap"), t_low/t_high, boot_low/boot_high,
    p (paired t test; None with one pair) and n.
    """
    t = paired_t(treated, control, level)
    boot = paired_bootstrap(treated, control, level=level)
    primary = t if t.n <= T_PRIMARY_MAX_N else boot
    return {
        "diff": t.mean,
        "low": primary.low,
        "high": primary.high,
        "method": "t" if primary is t else "bootstrap",
        "t_low": t.low,
        "t_high": t.high,
        "boot_low": boot.low,
        "boot_high": boot.high,
        "p": paired_t_p_value(treated, control),
        "n": t.n,
    }


def _diffs(treated: Sequence[float], control: Sequence[float]) -> list[float]:
    if len(treated) != len(control) or not treated:
        raise ValueError("need the same, non-zero number of treated and control values")
    return [a - b for a, b in zip(treated, control, strict=True)]
