"""Per-seed and paired figures of the protocol (`run`): one seed's RLEP run against its baseline, and the
paired differences over seeds (statistics: `compare`, `rlep.common.curves`). Pure functions over the runs' results."""

from __future__ import annotations

import statistics
from typing import Any

from rlep.common.curves import peak, steps_to_reach
from rlep.experiments.protocol.compare import censored_median, curve_auc
from rlep.experiments.protocol.intervals import both_intervals

# Fractions of the baseline's gain (start -> peak) at which both arms' steps are compared as well as at the peak: where
# along the climb replay saves steps, not only at its end.
GAIN_FRACTIONS = (0.5, 0.75, 0.9)


def gain_ratios(base: list, rlep: list) -> dict[str, float | None]:
    """Per fraction f of the baseline's gain: RLEP's steps to start + f x (peak - start) / the baseline's (None
    where RLEP never gets there)."""
    start, (_, top) = base[0][1], peak(base)
    out = {}
    for f in GAIN_FRACTIONS:
        level = start + f * (top - start)
        b, r = steps_to_reach(base, level), steps_to_reach(rlep, level)
        out[f"{f:.0%}"] = None if r is None or not b else r / b
    return out


def run_figures(base: dict, rlep: dict) -> dict[str, Any]:
    """One seed's figures: both arms over the same steps, RLEP measured against this seed's baseline peak."""
    base_peak_step, base_peak = peak(base["curve"])
    rlep_peak_step, rlep_peak = peak(rlep["curve"])
    reached = steps_to_reach(rlep["curve"], base_peak)
    last = min(base["curve"][-1][0], rlep["curve"][-1][0])
    return {
        "baseline_steps": base["steps"],
        "baseline_plateau_step": base["plateau_step"],
        "baseline_stopped_by": base.get("stopped_by", "plateau" if base["plateau_step"] else "cap"),
        "baseline_peak": base_peak,
        "baseline_peak_step": base_peak_step,
        "rlep_peak": rlep_peak,
        "rlep_peak_step": rlep_peak_step,
        "rlep_steps_to_baseline_peak": reached,
        "steps_ratio": None if reached is None or base_peak_step == 0 else reached / base_peak_step,
        # Where a seed never reaches it, its ratio is at least the run's last evaluation / the baseline's peak step.
        "steps_ratio_censored_at": None
        if reached is not None or base_peak_step == 0
        else rlep["curve"][-1][0] / base_peak_step,
        "steps_ratio_to_gain": gain_ratios(base["curve"], rlep["curve"]),
        "baseline_final": base["curve"][-1][1],
        "rlep_final": rlep["curve"][-1][1],
        "baseline_auc": curve_auc(base["curve"], last),
        "rlep_auc": curve_auc(rlep["curve"], last),
        "baseline_step_seconds": statistics.mean(base["step_seconds"]),
        "rlep_step_seconds": statistics.mean(rlep["step_seconds"]),
        "baseline_tokens_per_step": statistics.mean(base["response_tokens"]),
        "rlep_tokens_per_step": statistics.mean(rlep["response_tokens"]),
        "rlep_replayed_fraction": statistics.mean(rlep["replayed_fraction"]),
    }


PAIRED = [  # (label, baseline key, RLEP key)
    ("peak accuracy", "baseline_peak", "rlep_peak"),
    ("final accuracy", "baseline_final", "rlep_final"),
    ("mean accuracy (AUC / steps)", "baseline_auc", "rlep_auc"),
    ("step time (s)", "baseline_step_seconds", "rlep_step_seconds"),
    ("response tokens per step (est.)", "baseline_tokens_per_step", "rlep_tokens_per_step"),
]


def paired(per_seed: list[dict]) -> dict[str, dict]:
    """Paired differences RLEP - baseline with t intervals (bootstrap beside); steps to the peak over the seeds that
    reached it."""
    out = {}
    for label, b, r in PAIRED:
        out[label] = _interval([s[b] for s in per_seed], [s[r] for s in per_seed])
    reached = [s for s in per_seed if s["rlep_steps_to_baseline_peak"] is not None]
    out["steps to the baseline's peak"] = _interval(
        [s["baseline_peak_step"] for s in reached], [s["rlep_steps_to_baseline_peak"] for s in reached]
    )
    ratios = [s["steps_ratio"] for s in reached if s["steps_ratio"] is not None]
    out["RLEP steps / baseline steps to its peak"] = _ratio(ratios)
    out[MEDIAN_RATIO] = _median_ratio(per_seed)
    for fraction in GAIN_FRACTIONS:
        key = f"{fraction:.0%}"
        at = [s["steps_ratio_to_gain"][key] for s in per_seed if s["steps_ratio_to_gain"][key] is not None]
        out[f"RLEP steps / baseline steps to {key} of its gain"] = _ratio(at)
    out["seeds where RLEP reached the baseline's peak"] = {"reached": len(reached), "seeds": len(per_seed)}
    return out


MEDIAN_RATIO = "median steps ratio to the baseline's peak, all seeds (Kaplan-Meier)"


def _median_ratio(per_seed: list[dict]) -> dict:
    """The step ratio's median over all seeds, those that never reach the peak counted as censored at their run's
    end: unlike the mean over the seeds that reach it, it does not flatter an arm that often never gets there."""
    times = [(s["steps_ratio"], True) for s in per_seed if s["steps_ratio"] is not None]
    times += [(s["steps_ratio_censored_at"], False) for s in per_seed if s["steps_ratio_censored_at"] is not None]
    if not times:
        return {"n": 0}
    median = censored_median([t for t, _ in times], [r for _, r in times])
    return {"median": median, "n": len(times), "censored": sum(not r for _, r in times)}


def _interval(baseline: list[float], rlep: list[float]) -> dict:
    """Mean RLEP - baseline with its primary interval (t for n <= 10) and the bootstrap beside it (`intervals`)."""
    if not baseline:
        return {"n": 0}
    row = both_intervals(rlep, baseline)
    excludes_zero = row["n"] > 1 and (row["low"] > 0 or row["high"] < 0)
    return {"baseline_mean": statistics.mean(baseline), "rlep_mean": statistics.mean(rlep), **row} | {
        "excludes_zero": excludes_zero
    }


def _ratio(ratios: list[float]) -> dict:
    """Mean of per-seed step ratios with its primary interval; a speed-up is shown when that lies below 1."""
    if not ratios:
        return {"n": 0}
    row = both_intervals(ratios, [0.0] * len(ratios))
    return {"ratio": True, **row, "below_one": row["n"] > 1 and row["high"] < 1}
