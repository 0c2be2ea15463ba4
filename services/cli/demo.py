"""`rlep demo`: the paper's protocol in miniature, on one CPU machine with the embedded default.

1. Build the tiny model and give it a short supervised warm-up on a procedural arithmetic task
   with worked solutions (services/learner/task.py, warmup.py).
2. Baseline: RL with M=0 for S steps from the warm-up model.
3. Collect: the baseline's final policy samples N answers per training question; questions with
   at least 2 verified successes go to a replay pool.
4. RLEP: RL with M>0 for S steps from the SAME warm-up model, same seed and settings.
Both runs are evaluated on held-out problems every few steps. Output: a table, a PNG of accuracy
vs step, and results.json under the output directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import Field

from rlep.common.config import StrictModel
from rlep.services.learner.config import TrainConfig


class DemoConfig(StrictModel):
    """Sizes of the miniature protocol. Defaults were measured at 13-14 minutes on 2 CPU cores."""

    seed: int = 0
    out_dir: Path = Path("rlep-demo")
    warmup_steps: int = Field(400, ge=0)
    """Supervised steps before RL: 400 gives ~20% pass@1 at T=1 (150 gives ~9%, where RL barely moves)."""
    train_questions: int = Field(512, ge=8)
    eval_questions: int = Field(256, ge=8)
    eval_samples: int = Field(4, ge=1)
    """Samples per held-out question at each evaluation (T=1); accuracy is their mean."""
    steps: int = Field(100, ge=1)
    """S: RL steps of each run."""
    eval_every: int = Field(5, ge=1)
    questions_per_step: int = Field(16, ge=1)
    fresh_per_question: int = Field(8, ge=1)
    replayed_per_question: int = Field(2, ge=1)
    lr: float = Field(1e-4, gt=0)
    max_response_tokens: int = Field(40, ge=8)
    collect_samples: int = Field(16, ge=2)
    """N: samples per training question in the collection phase (paper: 64)."""


def demo_train_config(
    demo: DemoConfig, run_id: str, replayed: int, model: Path, data: Path, eval_data: Path
) -> TrainConfig:
    """Both runs start from `model` (the warm-up checkpoint) and differ only in M (`replayed`)."""
    return TrainConfig.model_validate(
        {
            "run_id": run_id,
            "model": str(model),
            "seed": demo.seed,
            "steps": demo.steps,
            "replay_pool": f"demo-seed{demo.seed}",
            "algorithm": {
                "questions_per_step": demo.questions_per_step,
                "fresh_per_question": demo.fresh_per_question,
                "replayed_per_question": replayed,
                "max_response_tokens": demo.max_response_tokens,
                "overlong_buffer_tokens": 8,
                "mini_batch_questions": demo.questions_per_step,
            },
            "optim": {"lr": demo.lr, "warmup_steps": 2, "weight_decay": 0.0, "micro_batch_size": 64},
            "deepspeed": {"zero_stage": 2},
            "checkpoint": {"dir": str(demo.out_dir / run_id), "every_steps": demo.steps},
            "data": {"train_files": [str(data)]},
            "eval": {
                "every_steps": demo.eval_every,
                "files": [str(eval_data)],
                "samples_per_question": demo.eval_samples,
                "temperature": 1.0,
                "max_questions": demo.eval_questions,
            },
            "local": {
                "rollout_cpus": 0.5,
                "learner_cpus": 1.0,
                "rollout_engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256},
            },
        }
    )


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """First step at which an accuracy curve reaches `target` (None if it never does)."""
    return next((step for step, accuracy in curve if accuracy >= target), None)


def summarize(baseline: list[dict], rlep: list[dict]) -> dict:
    def curve(records):
        return [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]

    def step_time(records):
        times = [r["step_seconds"] for r in records if "step_seconds" in r]
        return sum(times) / len(times) if times else 0.0

    base_curve, rlep_curve = curve(baseline), curve(rlep)
    base_peak = max(a for _, a in base_curve)
    return {
        "baseline_curve": base_curve,
        "rlep_curve": rlep_curve,
        "baseline_peak": base_peak,
        "baseline_peak_step": steps_to_reach(base_curve, base_peak),
        "rlep_peak": max(a for _, a in rlep_curve),
        "rlep_steps_to_baseline_peak": steps_to_reach(rlep_curve, base_peak),
        "baseline_final": base_curve[-1][1],
        "rlep_final": rlep_curve[-1][1],
        "baseline_step_seconds": step_time(baseline),
        "rlep_step_seconds": step_time(rlep),
    }


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (("baseline_curve", "baseline (M=0)"), ("rlep_curve", "RLEP (replay)")):
        steps, accuracy = zip(*summary[key], strict=True)
        ax.plot(steps, accuracy, marker="o", label=label)
    ax.axhline(summary["baseline_peak"], color="grey", linestyle=":", label="baseline peak")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (T=1)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(demo: DemoConfig, show_progress: bool = True) -> dict:
    from rich.console import Console

    from rlep.common.ray_local import init_ray
    from rlep.common.tiny_model import cached_model
    from rlep.services.cli.run import policy_tokenizer, run_training
    from rlep.services.cli.stack import ServiceStack
    from rlep.services.learner.collect import CollectConfig, collect, push_checkpoint
    from rlep.services.learner.data import load_questions
    from rlep.services.learner.task import make_problems, write_parquet
    from rlep.services.learner.warmup import warmup

    console = Console()
    out = demo.out_dir
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    train_data = write_parquet(make_problems(demo.train_questions, demo.seed, "train"), out / "train.parquet")
    eval_data = write_parquet(make_problems(demo.eval_questions, 0, "eval"), out / "eval.parquet")

    console.rule("1. supervised warm-up of the tiny model")
    warm = warmup(cached_model("tiny"), out / "warmup", demo.warmup_steps, seed=demo.seed, progress=show_progress)
    console.print(f"warm-up: {warm.steps} steps in {warm.train_seconds:.0f}s, pass@1 {warm.pass_at_1}")

    init_ray()
    baseline_config = demo_train_config(demo, "baseline", 0, warm.out_dir, train_data, eval_data)
    rlep_config = demo_train_config(demo, "rlep", demo.replayed_per_question, warm.out_dir, train_data, eval_data)
    stack = ServiceStack(baseline_config, warm.out_dir, app_name="rlep-demo-rollout")
    services = stack.start(need_replay=True)
    try:
        if baseline_config.replay_pool in services.replay.list_pools():
            services.replay.drop(baseline_config.replay_pool, confirm=baseline_config.replay_pool)
        records = {}
        console.rule("2. baseline RL (M=0)")
        records["baseline"] = _run(run_training, baseline_config, stack, show_progress)
        console.rule("3. collect successes with the baseline's final policy")
        final = demo.out_dir / "baseline" / f"step_{demo.steps}" / "hf"
        push_checkpoint(services.rollout, final)
        stats = collect(
            services,
            load_questions([train_data]),
            baseline_config.replay_pool,
            CollectConfig(
                samples_per_question=demo.collect_samples,
                max_response_tokens=demo.max_response_tokens,
                seed=demo.seed,
                run_id="demo-collect",
            ),
            show_progress=show_progress,
            tokenizer=policy_tokenizer(final, baseline_config),
        )
        console.print(
            f"collected: {stats.questions_kept}/{stats.questions} questions kept, "
            f"success rate {stats.success_rate:.1%}, {stats.successes_stored} successes stored"
        )
        console.rule("4. RLEP (replay) from the same warm-up model")
        records["rlep"] = _run(run_training, rlep_config, stack, show_progress)
    finally:
        stack.close()
    summary = summarize(records["baseline"], records["rlep"])
    summary.update(
        seed=demo.seed,
        warmup_pass_at_1=warm.pass_at_1,
        collect={"questions_kept": stats.questions_kept, "success_rate": stats.success_rate},
        total_seconds=time.perf_counter() - started,
        config=demo.model_dump(mode="json"),
    )
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out / "accuracy.png", f"RLEP vs baseline, tiny Qwen2 on 3-term sums (seed {demo.seed})")
    print_table(summary, console)
    console.print(f"plot: {out / 'accuracy.png'} · results: {out / 'results.json'}")
    return summary


def _run(run_training, config: TrainConfig, stack, show_progress: bool) -> list[dict]:
    records: list[dict] = []
    run_training(config, stack=stack, on_step=records.append, show_progress=show_progress)
    return records


def print_table(summary: dict, console) -> None:
    from rich.table import Table

    reached = summary["rlep_steps_to_baseline_peak"]
    table = Table(title="RLEP vs baseline (held-out accuracy, T=1)")
    for column in ("", "baseline (M=0)", "RLEP"):
        table.add_column(column, justify="right")
    table.add_row("peak accuracy", f"{summary['baseline_peak']:.3f}", f"{summary['rlep_peak']:.3f}")
    table.add_row(
        "steps to the baseline's peak",
        str(summary["baseline_peak_step"]),
        str(reached) if reached is not None else "not reached",
    )
    table.add_row("final accuracy", f"{summary['baseline_final']:.3f}", f"{summary['rlep_final']:.3f}")
    table.add_row(
        "mean step time (s)", f"{summary['baseline_step_seconds']:.2f}", f"{summary['rlep_step_seconds']:.2f}"
    )
    console.print(table)
