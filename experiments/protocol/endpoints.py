"""The protocol's named endpoints (issue 49), paired over seeds on one fixed horizon, and which pairs may be paired.

Named before the runs that decide (issue 49, stage 2), one per question:
- **early gain** (does replay climb faster?): the mean over the evaluations in (0, horizon / 3] of held-out
  accuracy, RLEP - baseline, per seed. Step 0 is left out: both arms start from one warm-up, so it adds a zero.
- **plateau** (does replay end higher?): the mean of each arm's last `PLATEAU_EVALUATIONS` evaluations at or
  before the horizon, RLEP - baseline, per seed. The decision rule (`decision`) reads this one.
- secondary, noise-sensitive: **peak** (the maximum of ~25 noisy evaluations: with equal plateaus RLEP reaches the
  baseline's maximum about half the time) and **plateau at each seed's own end** (where the baseline's stopping
  rule ended that seed, a horizon the baseline's noise chose).
- **late rescues**: groups per step whose fresh rows all scored alike that replay gave an advantage
  (`replay_signal_groups`), mean over the steps of the horizon's last third: whether replay still had anything to
  teach where the plateau is measured.

One horizon for every pair: the last step every run of the arm and of its baselines evaluated (runs of the archive
stopped where each seed's baseline plateaued: 400-600 steps; each is cut there, which the report says).

Pairing: both arms of a seed must have run on one CPU model and core count (runs record `pool.machine()`); the CPU
changes trajectories. A pair on different CPUs is left out of the paired interval and listed unpaired; a pair where
either arm did not record its CPU is kept and counted as unverified.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping

from rlep.experiments.protocol.intervals import both_intervals, holm

EARLY_FRACTION = 1 / 3
"""The early window: evaluations in (0, horizon x this]."""
PLATEAU_EVALUATIONS = 5
"""The plateau: the mean of this many last evaluations at or before the horizon."""
LATE_FRACTION = 1 / 3
"""Late rescues: steps in (horizon x (1 - this), horizon]."""
PRIMARY = ("early gain", "plateau")
SECONDARY = ("peak (secondary, noise-sensitive)", "plateau at each seed's own end (secondary)")
SAME, DIFFERENT, UNRECORDED = "same CPU", "different CPUs (unpaired)", "CPU not recorded (unverified)"


def cpu_model(machine: str | None) -> str | None:
    """The CPU model and core count of a `pool.machine()` string, its clock left out (the clock a run reads is the
    moment's, not the model's). None for runs from before runs recorded it."""
    if not machine:
        return None
    return re.sub(r", \d+ MHz\)", ")", machine)


def pairing(base: dict, arm: dict) -> str:
    """SAME, DIFFERENT or UNRECORDED for one seed's two runs."""
    a, b = cpu_model(base.get("machine")), cpu_model(arm.get("machine"))
    if a is None or b is None:
        return UNRECORDED
    return SAME if a == b else DIFFERENT


def last_step(run: dict) -> int:
    return int(run["curve"][-1][0])


def _upto(curve, horizon: int) -> dict[int, float]:
    return {int(s): a for s, a in curve if s <= horizon}


def early_window(base: dict, arm: dict, horizon: int) -> tuple[float, float]:
    """Both arms' mean accuracy over the evaluations both made in (0, horizon x EARLY_FRACTION]."""
    b, a = _upto(base["curve"], horizon), _upto(arm["curve"], horizon)
    steps = [s for s in sorted(b) if s in a and 0 < s <= horizon * EARLY_FRACTION]
    if not steps:
        raise ValueError(f"no evaluation of both arms in (0, {horizon * EARLY_FRACTION:.0f}]")
    return statistics.fmean(b[s] for s in steps), statistics.fmean(a[s] for s in steps)


def plateau(run: dict, horizon: int, evaluations: int = PLATEAU_EVALUATIONS) -> float:
    """Mean of the run's last `evaluations` evaluations at or before `horizon`."""
    values = list(_upto(run["curve"], horizon).values())
    if len(values) < evaluations:
        raise ValueError(f"{len(values)} evaluations up to step {horizon}, the plateau needs {evaluations}")
    return statistics.fmean(values[-evaluations:])


def late_rescues(run: dict, horizon: int) -> float | None:
    """Mean rescued groups per step over steps (horizon x (1 - LATE_FRACTION), horizon]; None where not recorded
    (runs from before steps recorded it, and baselines, which replay nothing)."""
    per_step = run.get("replay_signal_groups") or []
    start = horizon - round(horizon * LATE_FRACTION)
    values = [v for v in per_step[start:horizon] if v is not None]  # entry i is step i + 1
    return statistics.fmean(values) if values else None


def arm_endpoints(baseline: Mapping[int, dict], arm: Mapping[int, dict], horizon: int | None = None) -> dict:
    """Every endpoint of one arm against the baselines of the same seeds, on one horizon.

    Returns horizon, pairing (status -> seeds), endpoints (name -> `both_intervals` row plus baseline/arm means,
    over the pairs that may be paired), unpaired (seed -> name -> (baseline, arm)) and late_rescues (mean over the
    paired seeds that record it, and how many do).
    """
    seeds = sorted(arm)
    horizon = horizon or min(min(last_step(baseline[s]), last_step(arm[s])) for s in seeds)
    status = {s: pairing(baseline[s], arm[s]) for s in seeds}
    values: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in (*PRIMARY, *SECONDARY)}
    for s in seeds:
        b, a = baseline[s], arm[s]
        values["early gain"][s] = early_window(b, a, horizon)
        values["plateau"][s] = (plateau(b, horizon), plateau(a, horizon))
        values[SECONDARY[0]][s] = (max(_upto(b["curve"], horizon).values()), max(_upto(a["curve"], horizon).values()))
        own = min(last_step(b), last_step(a))
        values[SECONDARY[1]][s] = (plateau(b, own), plateau(a, own))
    paired = [s for s in seeds if status[s] != DIFFERENT]
    endpoints = {}
    for name, per_seed in values.items():
        if not paired:
            endpoints[name] = {"n": 0}
            continue
        base_values, arm_values = [per_seed[s][0] for s in paired], [per_seed[s][1] for s in paired]
        endpoints[name] = both_intervals(arm_values, base_values) | {
            "baseline_mean": statistics.fmean(base_values),
            "arm_mean": statistics.fmean(arm_values),
            "per_seed": {s: per_seed[s][1] - per_seed[s][0] for s in paired},
        }
    rescues = [r for s in paired if (r := late_rescues(arm[s], horizon)) is not None]
    return {
        "horizon": horizon,
        "early_window": [0, int(horizon * EARLY_FRACTION)],
        "pairing": {label: [s for s in seeds if status[s] == label] for label in (SAME, UNRECORDED, DIFFERENT)},
        "endpoints": endpoints,
        "unpaired": {s: {name: values[name][s] for name in values} for s in seeds if status[s] == DIFFERENT},
        "late_rescues": {"mean": statistics.fmean(rescues) if rescues else None, "seeds": len(rescues)},
    }


def ablation_endpoints(
    baseline: Mapping[int, dict], cells: Mapping[str, Mapping[int, dict]], reference: Mapping[int, dict]
) -> dict:
    """Each exploratory cell's endpoints against the same seeds' baselines, beside the protocol's RLEP on those
    seeds (`reference`, outside the family), on the horizon they all share, with Holm-adjusted p-values (paired t
    test) across the cells for each primary endpoint: with several cells, one of them clearing p < 0.05 by chance is
    likely, so none is a finding on its own p."""
    runs = [r for cell in (*cells.values(), reference) for r in cell.values()]
    runs += [baseline[s] for s in reference]
    horizon = min(last_step(r) for r in runs)
    out = {name: arm_endpoints(baseline, cell, horizon) for name, cell in cells.items()}
    for endpoint in PRIMARY:
        p = {name: row["endpoints"][endpoint].get("p") for name, row in out.items()}
        adjusted = holm({name: v for name, v in p.items() if v is not None})
        for name, row in out.items():
            row["endpoints"][endpoint]["p_holm"] = adjusted.get(name)
    return {"horizon": horizon, "reference": arm_endpoints(baseline, reference, horizon), "cells": out}
