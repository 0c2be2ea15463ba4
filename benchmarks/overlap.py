"""Overlapped steps vs synchronous steps, side by side in one invocation: the demo's configuration.

Both runs start from the same warm-up checkpoint with the same seed, settings and services (one local stack);
they differ only in `algorithm.max_staleness`: 0 (the paper's synchronous step) and k (default 1: the next
step's samples are generated and scored while this step trains). With the demo's replay pool present in the
embedded Redis (left by `make demo`) both runs are the demo's RLEP run (M=2); otherwise the baseline (M=0),
as the table says.

Prints, per run: mean step time and its phases, steps/s, the ratio k / sync (goal >= 1.3 on 2 cores; the
upper bound from the phases is ~1.4), staleness, and held-out accuracy at equal step counts; plots both
accuracy curves in one PNG. Step time excludes the periodic evaluations in both runs.

    python benchmarks/overlap.py [--steps 100] [--staleness 1] [--out-dir rlep-bench-overlap] [--json FILE]
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
    from rlep.services.cli.demo import load_demo_config
    from rlep.services.learner.task import make_problems, write_parquet
    from rlep.services.learner.warmup import warmup

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


def run(demo, warm_dir, train_data, eval_data, stack, staleness: int, replayed: int) -> dict:
    from rlep.services.cli.demo import demo_train_config
    from rlep.services.cli.run import run_training

    name = f"staleness-{staleness}"
    config = demo_train_config(demo, name, replayed, warm_dir, train_data, eval_data)
    algorithm = config.algorithm.model_copy(update={"max_staleness": staleness})
    config = config.model_copy(update={"algorithm": algorithm, "log_file": Path(demo.out_dir) / f"{name}.jsonl"})
    config.log_file.unlink(missing_ok=True)
    console.rule(f"{demo.steps} steps, max_staleness={staleness}, M={replayed}")
    started = time.perf_counter()
    records = run_training(config, stack=stack, show_progress=True)
    wall = time.perf_counter() - started
    steps = [r.step_seconds for r in records]
    return {
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
        label = (
            "synchronous" if result["max_staleness"] == 0 else f"overlapped (max_staleness={result['max_staleness']})"
        )
        ax.plot(steps, accuracy, marker="o", label=f"{label}: {result['steps_per_second']:.2f} steps/s")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (T=1)")
    ax.set_title(f"Synchronous vs overlapped steps (M={results[0]['replayed_per_question']}, same seed)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: list[dict], samples: int) -> None:
    sync, ahead = results
    table = Table(title="Synchronous vs overlapped steps (the demo's configuration, one invocation)")
    table.add_column("")
    for r in results:
        table.add_column(f"max_staleness={r['max_staleness']}", justify="right")
    table.add_row("mean step time (s)", *(f"{r['mean_step_seconds']:.3f}" for r in results))
    for phase in PHASES:
        table.add_row(f"  {phase} (s, mean)", *(f"{r['phase_seconds'][phase]:.3f}" for r in results))
    table.add_row("steps/s", *(f"{r['steps_per_second']:.3f}" for r in results))
    table.add_row("ratio to synchronous", "1.00", f"{ahead['steps_per_second'] / sync['steps_per_second']:.2f}")
    table.add_row("run wall time incl. evaluations (s)", *(f"{r['wall_seconds']:.0f}" for r in results))
    table.add_row("staleness max / mean", *(f"{r['staleness_max']} / {r['staleness_mean']:.2f}" for r in results))
    table.add_row("groups dropped as stale", *(str(r["groups_dropped_stale"]) for r in results))
    console.print(table)

    curves = Table(title=f"Held-out accuracy at equal step counts ({samples} samples per evaluation)")
    for column in ("step", "synchronous", f"max_staleness={ahead['max_staleness']}", "difference", "1 s.e."):
        curves.add_column(column, justify="right")
    diffs = []
    for (step, a), (_, b) in zip(sync["curve"], ahead["curve"], strict=True):
        diffs.append(b - a)
        noise = (eval_noise(a, samples) ** 2 + eval_noise(b, samples) ** 2) ** 0.5
        curves.add_row(str(step), f"{a:.3f}", f"{b:.3f}", f"{b - a:+.3f}", f"{noise:.3f}")
    console.print(curves)
    console.print(
        f"mean difference {statistics.fmean(diffs):+.3f}, mean |difference| {statistics.fmean(map(abs, diffs)):.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="steps of each run (the demo's S)")
    parser.add_argument("--staleness", type=int, default=1, help="max_staleness of the overlapped run")
    parser.add_argument("--out-dir", default="rlep-bench-overlap")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    from rlep.common.ray_local import init_ray
    from rlep.services.cli.demo import demo_train_config
    from rlep.services.cli.stack import ServiceStack

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
        results = [run(demo, warm_dir, train_data, eval_data, stack, k, replayed) for k in (0, args.staleness)]
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
