"""Overlapped steps vs synchronous steps, side by side in one invocation: the demo's configuration.

Every run starts from the same warm-up checkpoint with the same settings and services (one local stack). Runs:
  sync        max_staleness 0 (the paper's synchronous step), seed S: the reference;
  k           max_staleness k (default 1: the next step's samples are generated and scored while this step
              trains), seed S, old logprobs recomputed by the learner (behavior_correction none);
  k+tis       the same with behavior_correction truncated_is (AReaL's decoupled objective, truncated weights);
  sync seed S+1, ...  (--yardstick-seeds) the synchronous step with other RL seeds: how far two synchronous
              runs drift apart by chance alone, the yardstick the overlapped runs' accuracy is judged by (the
              evaluation's own standard error is far smaller than the spread between RL runs).
With the demo's replay pool present in the embedded Redis (left by `make demo`) every run is the demo's RLEP run
(M=2); otherwise the baseline (M=0), as the table says.

Prints, per run: mean step time and its phases, steps/s, the ratio to synchronous (goal >= 1.3 on 2 cores; the
upper bound from the phases is ~1.4), staleness, and held-out accuracy at equal step counts with each run's mean
and mean absolute difference from the reference; plots every accuracy curve in one PNG. Step time excludes the
periodic evaluations in every run.

    python benchmarks/overlap.py [--steps 100] [--staleness 1] [--yardstick-seeds 1] [--out-dir rlep-bench-overlap]
                                 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 140)
PHASES = ("rollout", "verify", "replay", "train", "weight_push", "rollout_wait")


def prepare(args):
    """The demo's settings, data and warm-up checkpoint (reused when this output directory has it)."""
    from rlep.common.tiny_model import cached_model
    from rlep.services.demo.runner import load_demo_config
    from rlep.services.demo.task import make_problems, write_parquet
    from rlep.services.demo.warmup import warmup

    demo = load_demo_config(sets=[f"steps={args.steps}", f"out_dir={args.out_dir}"])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_data = write_parquet(make_problems(demo.train_questions, demo.seed, "train"), out / "train.parquet")
    eval_data = write_parquet(make_problems(demo.eval_questions, 0, "eval"), out / "eval.parquet")
    warm_dir = out / "warmup"
    stamp = {"steps": demo.warmup_steps, "seed": demo.seed}
    done = warm_dir / "warmup.json"
    if not (done.exists() and all(json.loads(done.read_text()).get(k) == v for k, v in stamp.items())):
        console.rule("supervised warm-up of the tiny model (once per output directory)")
        warmup(cached_model("tiny"), warm_dir, demo.warmup_steps, seed=demo.seed)
    return demo, warm_dir, train_data, eval_data


def run(demo, warm_dir, train_data, eval_data, stack, arm: dict, replayed: int) -> dict:
    from rlep.services.demo.runner import demo_train_config
    from rlep.services.launch.training import run_training
    from rlep.services.learner.config import TrainConfig

    staleness, correction, seed = arm["max_staleness"], arm["behavior_correction"], arm["seed"]
    name = arm["name"]
    config = demo_train_config(demo, name, replayed, warm_dir, train_data, eval_data)
    update = {"max_staleness": staleness, "behavior_correction": correction}
    config = TrainConfig.model_validate(
        config.model_dump()
        | {"seed": seed, "algorithm": config.algorithm.model_dump() | update}
        | {"log_file": Path(demo.out_dir) / f"{name}.jsonl"}
    )
    config.log_file.unlink(missing_ok=True)
    console.rule(f"{name}: {demo.steps} steps, max_staleness={staleness}, {correction}, seed {seed}, M={replayed}")
    started = time.perf_counter()
    records = run_training(config, stack=stack, show_progress=True)
    wall = time.perf_counter() - started
    steps = [r.step_seconds for r in records]
    return {
        "name": name,
        "seed": seed,
        "behavior_correction": correction,
        "max_staleness": staleness,
        "replayed_per_question": replayed,
        "steps": len(records),
        "mean_step_seconds": statistics.fmean(steps),
        "steps_per_second": len(steps) / sum(steps),
        "wall_seconds": wall,
        "phase_seconds": {p: statistics.fmean(r.phase_seconds.get(p, 0.0) for r in records) for p in PHASES},
        "staleness_max": max(r.policy_staleness_max for r in records),
        "staleness_mean": statistics.fmean(r.policy_staleness_mean for r in records),
        "groups_dropped_stale": sum(r.groups_dropped_stale for r in records),
        "curve": [(r.step, r.eval_accuracy) for r in records if r.eval_accuracy is not None],
    }


def eval_noise(accuracy: float, samples: int) -> float:
    """One standard error of an accuracy measured on `samples` independent samples (an underestimate when
    several samples share a question)."""
    return (accuracy * (1 - accuracy) / samples) ** 0.5


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for result in results:
        steps, accuracy = zip(*result["curve"], strict=True)
        yardstick = result["name"].startswith("sync") and result is not results[0]
        ax.plot(
            steps,
            accuracy,
            marker="." if yardstick else "o",
            linestyle=":" if yardstick else "-",
            label=f"{result['name']}: {result['steps_per_second']:.2f} steps/s",
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (T=1)")
    ax.set_title(f"Synchronous vs overlapped steps (M={results[0]['replayed_per_question']}; dotted: other RL seeds)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: list[dict], samples: int) -> None:
    reference = results[0]
    table = Table(title="Synchronous vs overlapped steps (the demo's configuration, one invocation)")
    table.add_column("")
    for r in results:
        table.add_column(r["name"], justify="right")
    table.add_row(
        "max_staleness / correction", *(f"{r['max_staleness']} / {r['behavior_correction']}" for r in results)
    )
    table.add_row("RL seed", *(str(r["seed"]) for r in results))
    table.add_row("mean step time (s)", *(f"{r['mean_step_seconds']:.3f}" for r in results))
    for phase in PHASES:
        table.add_row(f"  {phase} (s, mean)", *(f"{r['phase_seconds'][phase]:.3f}" for r in results))
    table.add_row("steps/s", *(f"{r['steps_per_second']:.3f}" for r in results))
    table.add_row(
        "ratio to synchronous", *(f"{r['steps_per_second'] / reference['steps_per_second']:.2f}" for r in results)
    )
    table.add_row("run wall time incl. evaluations (s)", *(f"{r['wall_seconds']:.0f}" for r in results))
    table.add_row("staleness max / mean", *(f"{r['staleness_max']} / {r['staleness_mean']:.2f}" for r in results))
    table.add_row("groups dropped as stale", *(str(r["groups_dropped_stale"]) for r in results))
    console.print(table)

    curves = Table(title=f"Held-out accuracy at equal step counts ({samples} samples per evaluation)")
    curves.add_column("step", justify="right")
    for r in results:
        curves.add_column(r["name"], justify="right")
    curves.add_column("1 s.e.", justify="right")
    for i, (step, a) in enumerate(reference["curve"]):
        row = [r["curve"][i][1] for r in results]
        curves.add_row(str(step), *(f"{v:.3f}" for v in row), f"{eval_noise(a, samples):.3f}")
    means = [statistics.fmean(v for _, v in r["curve"]) for r in results]
    curves.add_row("mean", *(f"{m:.3f}" for m in means), "")
    for r in results:
        diffs = [b - a for (_, a), (_, b) in zip(reference["curve"], r["curve"], strict=True)]
        r["mean_difference"] = statistics.fmean(diffs)
        r["mean_abs_difference"] = statistics.fmean(map(abs, diffs))
    curves.add_row("mean diff vs " + reference["name"], *(f"{r['mean_difference']:+.3f}" for r in results), "")
    curves.add_row("mean |diff| vs " + reference["name"], *(f"{r['mean_abs_difference']:.3f}" for r in results), "")
    console.print(curves)
    yardsticks = [r for r in results[1:] if r["max_staleness"] == 0]
    if yardsticks:
        spread = max(r["mean_abs_difference"] for r in yardsticks)
        console.print(
            f"synchronous runs with other RL seeds differ from the reference by mean |diff| up to {spread:.3f}: "
            "an overlapped run within that agrees as well as two synchronous runs do"
        )


def arms(staleness: int, seed: int, yardstick_seeds: int) -> list[dict]:
    runs = [
        {"name": "sync", "max_staleness": 0, "behavior_correction": "none", "seed": seed},
        {"name": f"k={staleness}", "max_staleness": staleness, "behavior_correction": "none", "seed": seed},
        {"name": f"k={staleness}+tis", "max_staleness": staleness, "behavior_correction": "truncated_is", "seed": seed},
    ]
    for extra in range(1, yardstick_seeds + 1):
        runs.append(
            {
                "name": f"sync seed {seed + extra}",
                "max_staleness": 0,
                "behavior_correction": "none",
                "seed": seed + extra,
            }
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="steps of each run (the demo's S)")
    parser.add_argument("--staleness", type=int, default=1, help="max_staleness of the overlapped runs")
    parser.add_argument("--yardstick-seeds", type=int, default=1, help="synchronous runs with other RL seeds")
    parser.add_argument("--out-dir", default="rlep-bench-overlap")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    from rlep.common.ray_local import init_ray
    from rlep.services.demo.runner import demo_train_config
    from rlep.services.launch.stack import ServiceStack

    demo, warm_dir, train_data, eval_data = prepare(args)
    init_ray()
    probe = demo_train_config(demo, "probe", demo.replayed_per_question, warm_dir, train_data, eval_data)
    stack = ServiceStack(probe, warm_dir, app_name="rlep-bench-overlap")
    services = stack.start(need_replay=True)
    try:
        pool_ready = probe.replay_pool in services.replay.list_pools()
        replayed = demo.replayed_per_question if pool_ready else 0
        if not pool_ready:
            console.print(f"[yellow]no pool {probe.replay_pool!r} (run `make demo` first): comparing with M=0")
        results = [
            run(demo, warm_dir, train_data, eval_data, stack, arm, replayed)
            for arm in arms(args.staleness, demo.seed, args.yardstick_seeds)
        ]
    finally:
        stack.close()
    samples = min(demo.eval_questions, probe.eval.max_questions) * demo.eval_samples
    report(results, samples)
    png = Path(args.out_dir) / "overlap.png"
    plot(results, png)
    console.print(f"plot: {png}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
