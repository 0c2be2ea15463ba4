"""Figures of one held-out accuracy curve, which the demo's table and the protocol's report share.

A curve is `[(step, accuracy), ...]` in step order, as the learner's periodic evaluation logs it (step 0 = the
starting weights). `peak` and `steps_to_reach` are the RLEP paper's comparison: the baseline's peak and the steps
the other run takes to reach it. The statistics over several runs are the protocol's
(`experiments/protocol/compare.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

Curve = Sequence[tuple[int, float]]


def peak(curve: Curve) -> tuple[int, float]:
    """(first step reaching the curve's maximum, that maximum)."""
    if not curve:
        raise ValueError("empty curve")
    best = max(accuracy for _, accuracy in curve)
    return next(step for step, accuracy in curve if accuracy >= best), best


def steps_to_reach(curve: Curve, target: float) -> int | None:
    """First step at which `curve` reaches `target`; None if it never does."""
    return next((step for step, accuracy in curve if accuracy >= target), None)
