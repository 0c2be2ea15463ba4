"""`rlep demo`: the paper's protocol in miniature, on one CPU machine with the embedded default.

1. Build the tiny model and give it a short supervised warm-up on a procedural arithmetic task
   with worked solutions (services/demo/task.py, warmup.py).
2. Baseline: RL with M=0 for S steps from the warm-up model.
3. Collect: the baseline's final policy samples N answers per training question; questions with
   at least 2 verified successes go to a replay pool.
4. RLEP: RL with M>0 for S steps from the SAME warm-up model, same seed and settings.
Both runs are evaluated on held-out problems every few steps. Output: a table, a PNG of accuracy
vs step, and results.json under the output directory; each run's TensorBoard files are under
<out_dir>/<run>/tensorboard (docs/tracking.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import Field, SerializationInfo, field_serializer

from rlep.common.config import CONFIG_DIR, StrictModel, deep_merge, load_config
from rlep.common.curves import peak, steps_to_reach
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.records import LogRecord, StepRecord

# The demo's settings; `rlep demo --config FILE` is read over them.
DEMO_CONFIG_FILE = CONFIG_DIR / "demo.yaml"


class DemoConfig(StrictModel):
    """Sizes of the miniature protocol. Every value comes from configs/demo.yaml (load_demo_config)."""

    seed: int
    """Seed of the data, the warm-up and both RL runs."""
    out_dir: Path
    """Where checkpoints, results.json and accuracy.png go."""
    warmup_steps: int = Field(ge=0)
    """Supervised steps before RL."""
    train_questions: int = Field(ge=8)
    """Generated training problems (the RL runs and the collection draw from them)."""
    eval_questions: int = Field(ge=8)
    """Held-out problems each evaluation scores."""
    eval_samples: int = Field(ge=1)
    """Samples per held-out question at each evaluation (T=1); accuracy is their mean."""
    steps: int = Field(ge=1)
    """S: RL steps of each run."""
    eval_every: int = Field(ge=1)
    """Steps between evaluations."""
    questions_per_step: int = Field(ge=1)
    """B: questions per RL step; also the runs' `mini_batch_questions`."""
    fresh_per_question: int = Field(ge=1)
    """G: fresh rollouts per question."""
    replayed_per_question: int = Field(ge=1)
    """M of the RLEP run (the baseline runs with 0)."""
    lr: float = Field(gt=0)
    """Learning rate of both runs."""
    max_response_tokens: int = Field(ge=8)
    """Generation limit of both runs and of the collection."""
    collect_samples: int = Field(ge=2)
    """N: samples per training question in the collection phase."""
    train: TrainConfig
    """What both RL runs share. demo_train_config sets each run's names, paths and the sizes above over it."""

    @field_serializer("train")
    def _set_fields_only(self, train: TrainConfig, info: SerializationInfo) -> dict:
        # Only what the file set: the rest are TrainConfig defaults (or per-run values), noise in results.json.
        return train.model_dump(mode=info.mode, exclude_unset=True)


def load_demo_config(path: Path | None = None, sets: list[str] | None = None, flags: dict | None = None) -> DemoConfig:
    """configs/demo.yaml < `path` < env (`RLEP_DEMO__STEPS=20`) < `sets` (`steps=20`) < `flags` (None: unset)."""
    return load_config(DemoConfig, path, flags, env_prefix="demo", sets=sets, base=DEMO_CONFIG_FILE)


def demo_train_config(
    demo: DemoConfig, run_id: str, replayed: int, model: Path, data: Path, eval_data: Path
) -> TrainConfig:
    """Both runs start from `model` (the warm-up checkpoint) and differ only in M (`replayed`)."""
    run = {
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
            "mini_batch_questions": demo.questions_per_step,
        },
        "optim": {"lr": demo.lr},
        # The demo's pool lives with its other files, not in the Redis a user's own runs share.
        "local": {"replay_redis_dir": str((demo.out_dir / "redis").resolve())},
        "checkpoint": {"dir": str(demo.out_dir / run_id), "every_steps": demo.steps},
        "data": {"train_files": [str(data)]},
        "eval": {
            "every_steps": demo.eval_every,
            "files": [str(eval_data)],
            "samples_per_question": demo.eval_samples,
            "max_questions": demo.eval_questions,
        },
    }
    return TrainConfig.model_validate(deep_merge(demo.train.model_dump(exclude_unset=True), run))


def summarize(baseline: list[LogRecord], rlep: list[LogRecord]) -> dict:
    def curve(records: list[LogRecord]) -> list[tuple[int, float]]:
        return [(r.step, r.eval_accuracy) for r in records if r.eval_accuracy is not None]

    def step_time(records: list[LogRecord]) -> float:
        times = [r.step_seconds for r in records if isinstance(r, StepRecord)]
        return sum(times) / len(times) if times else 0.0

    base_curve, rlep_curve = curve(baseline), curve(rlep)
    base_peak_step, base_peak = peak(base_curve)
    return {
        "baseline_curve": base_curve,
        "rlep_curve": rlep_curve,
        "baseline_peak": base_peak,
        "baseline_peak_step": base_peak_step,
        "rlep_peak": peak(rlep_curve)[1],
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
    from rlep.services.demo.task import make_problems, write_parquet
    from rlep.services.demo.warmup import warmup
    from rlep.services.launch.collection import collect_pool
    from rlep.services.launch.stack import ServiceStack
    from rlep.services.launch.training import run_training
    from rlep.services.learner.config import CollectConfig
    from rlep.services.learner.cursor import load_questions
    from rlep.services.learner.tracking import tensorboard_dir

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
    boards = [tensorboard_dir(c) for c in (baseline_config, rlep_config) if tensorboard_dir(c) is not None]
    if boards:  # printed now so the curves can be watched while the runs train
        console.print(f"TensorBoard logs: {', '.join(map(str, boards))} (open with: tensorboard --logdir {out})")
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
        collect_config = CollectConfig(
            samples_per_question=demo.collect_samples,
            max_response_tokens=demo.max_response_tokens,
            seed=demo.seed,
            run_id="demo-collect",
        )
        questions = load_questions([train_data])
        stats = collect_pool(
            baseline_config,
            final,
            questions,
            baseline_config.replay_pool,
            collect_config,
            stack,
            show_progress=show_progress,
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


def _run(run_training, config: TrainConfig, stack, show_progress: bool) -> list[LogRecord]:
    records: list[LogRecord] = []
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
