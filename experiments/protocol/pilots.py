"""Pilots of candidate tasks for the RLEP protocol (issue 29): which task leaves plain RL room to improve.

The protocol's task (sums of 4 numbers in [1, 16], 600 warm-up steps) starts at ~0.37 and its baselines plateau near
0.52: little for replay to speed up. For each candidate (numbers per sum, their range, warm-up steps) this runs
1. the supervised warm-up (cached under ~/.cache/rlep/warmup/, shared with the protocol when the settings match);
2. one plain-RL baseline (M=0, seed 0) with the protocol's sizes until it stops improving: no new best beyond
   `min_delta` (about one standard error of an evaluation) over `patience` evaluations in a row, or the cap.
It reports the warm-up's pass@1 (T=1, 256 held-out problems), the RL curve's first evaluation (the start), its peak
and where, the final, and peak / start. The issue's bar: start <= 20% and a converged baseline >= 2.5x higher.

    python -m rlep.experiments.protocol.pilots                  # every candidate, in order (~25 min each on 2 cores)
    python -m rlep.experiments.protocol.pilots --only sum5-20   # one (repeat --only for several)
    python -m rlep.experiments.protocol.pilots --report-only    # the table of what has finished

Each finished pilot is kept under work_dir/<name>/ and reused on a rerun; the JSON and PNG go to `results`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rlep.common.curves import peak
from rlep.experiments.protocol.config import ProtocolConfig, run_config
from rlep.experiments.protocol.training import shared_warmup, train_run

# name -> ProtocolConfig values. Response limits leave room for the longest worked solution of the task
# (character-level tokenizer: "a+b=c, " is ~7-9 tokens per step, "\boxed{n}" one token plus the digits).
CANDIDATES: dict[str, dict[str, Any]] = {
    "sum4-16-w200": {"terms": 4, "max_value": 16, "warmup_steps": 200},
    "sum5-20": {"terms": 5, "max_value": 20, "warmup_steps": 600, "max_response_tokens": 64},
    "sum3-50": {"terms": 3, "max_value": 50, "warmup_steps": 600},
    "sum5-20-w300": {"terms": 5, "max_value": 20, "warmup_steps": 300, "max_response_tokens": 64},
    "sum4-20-w400": {"terms": 4, "max_value": 20, "warmup_steps": 400},
    "sum3-50-w400": {"terms": 3, "max_value": 50, "warmup_steps": 400},
}
# What every pilot shares: one seed, a cheaper evaluation (500 questions: SE <= 0.022), the plateau rule
# (no new best beyond ~1 SE over 5 evaluations), and a cap far beyond the protocol baselines' 60-200 steps.
PILOT = {
    "seeds": [0],
    "eval_questions": 500,
    "eval_every": 10,
    "horizon": "plateau",
    "patience": 5,
    "min_delta": 0.02,
    "max_steps": 400,
}
WORK_DIR = Path("runs/task-pilots")
RESULTS = Path("experiments/protocol/results/pilots")
BAR_START, BAR_GAIN = 0.20, 2.5


def pilot_config(name: str, work_dir: Path = WORK_DIR) -> ProtocolConfig:
    return ProtocolConfig.model_validate({**PILOT, **CANDIDATES[name], "work_dir": str(work_dir / name)})


def run_pilot(name: str, work_dir: Path = WORK_DIR) -> dict:
    """Warm-up and one baseline to its plateau for candidate `name`; returns its figures (cached per pilot)."""
    from rlep.common.ray_local import init_ray
    from rlep.services.demo.task import make_problems, write_parquet
    from rlep.services.launch.stack import ServiceStack

    cfg = pilot_config(name, work_dir)
    done = cfg.work_dir / "pilot.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", cfg.train_questions), ("eval", cfg.eval_questions)):
        problems = make_problems(count, 0, split, cfg.terms, cfg.max_value)
        write_parquet(problems, cfg.work_dir / f"{split}.parquet")
    warm, warm_pass = shared_warmup(cfg)
    init_ray()
    config = run_config(cfg, "baseline-s0", 0, cfg.max_steps, warm, "pilot-unused", {})
    stack = ServiceStack(config, warm, app_name=f"rlep-pilot-{name}")
    stack.start(need_replay=True)
    try:
        run = train_run(config, stack, cfg)
    finally:
        stack.close()
    figures = pilot_figures(name, warm_pass, run)
    done.write_text(json.dumps(figures))
    return figures


def pilot_figures(name: str, warmup_pass_at_1: float | None, run: dict) -> dict:
    curve = [tuple(point) for point in run["curve"]]
    start = curve[0][1]
    peak_step, best = peak(curve)
    return {
        "name": name,
        "task": {k: v for k, v in CANDIDATES[name].items()},
        "warmup_pass_at_1": warmup_pass_at_1,
        "start": start,
        "peak": best,
        "peak_step": peak_step,
        "final": curve[-1][1],
        "steps": run["steps"],
        "plateau_step": run["plateau_step"],
        "capped": run["plateau_step"] is None,
        "gain": None if start == 0 else best / start,
        "meets_bar": start <= BAR_START and best >= BAR_GAIN * start and best > start,
        "step_seconds_mean": sum(run["step_seconds"]) / len(run["step_seconds"]),
        "wall_seconds": run["wall_seconds"],
        "curve": curve,
    }


def report(pilots: list[dict], results: Path = RESULTS) -> None:
    """A rich table, the JSON and a PNG of the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Task pilots (bar: start <= {BAR_START:.0%}, peak >= {BAR_GAIN}x start)")
    for column in ("task", "warm-up pass@1", "start", "peak (step)", "final", "peak/start", "stopped", "s/step"):
        table.add_column(column)
    for p in pilots:
        stopped = "cap" if p["capped"] else f"plateau @{p['plateau_step']}"
        table.add_row(
            p["name"],
            "-" if p["warmup_pass_at_1"] is None else f"{p['warmup_pass_at_1']:.3f}",
            f"{p['start']:.3f}",
            f"{p['peak']:.3f} ({p['peak_step']})",
            f"{p['final']:.3f}",
            "-" if p["gain"] is None else f"{p['gain']:.2f}x" + (" ok" if p["meets_bar"] else ""),
            stopped,
            f"{p['step_seconds_mean']:.2f}",
        )
    Console(width=140).print(table)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.with_suffix(".json").write_text(json.dumps(pilots, indent=1))
    figure, axes = plt.subplots(figsize=(7, 4))
    for p in pilots:
        steps, accuracy = zip(*p["curve"], strict=True)
        axes.plot(steps, accuracy, marker=".", label=p["name"])
    axes.axhline(BAR_START, color="grey", linestyle=":", linewidth=1)
    axes.set(xlabel="RL step (plain baseline, seed 0)", ylabel="held-out accuracy (500 questions)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(results.with_suffix(".png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(CANDIDATES), help="run only this candidate")
    parser.add_argument("--report-only", action="store_true", help="report the pilots that have finished")
    parser.add_argument("--work-dir", type=Path, default=WORK_DIR)
    args = parser.parse_args()
    names = args.only or list(CANDIDATES)
    pilots = []
    for name in names:
        done = pilot_config(name, args.work_dir).work_dir / "pilot.json"
        if args.report_only:
            if done.exists():
                pilots.append(json.loads(done.read_text()))
            continue
        pilots.append(run_pilot(name, args.work_dir))
        report(pilots)  # after each pilot: what has finished is on disk even if the next one is cut off
    if pilots:
        report(pilots)
    else:
        print(f"no pilot has finished under {args.work_dir}")


if __name__ == "__main__":
    main()
