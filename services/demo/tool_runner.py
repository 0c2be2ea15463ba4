"""`rlep demo --task tools`: a task where the tool matters, end to end on one CPU machine (issue 50, part 4).

Sums of five numbers in [1, 20] (`tool_task`): by hand, four additions the tiny model gets wrong often; with the
sandboxed Python tool, one line of code. Three RL runs of S steps, the same seed and sizes, each evaluated on
held-out questions every few steps (with its own tools, T=1):

1. `no tools`: warm-up on worked solutions only, RL without tools: what direct answers reach.
2. `tools`: warm-up where a `tool_share` of the examples are tool traces (the tool's tokens out of the loss), RL
   with tool episodes, rewarding only the final answer (plain RL, M=0).
3. `tools + RLEP`: the `tools` run's final policy samples N episodes per training question; its verified traces go
   to a replay pool; RL again from the same warm-up, M of them replayed whole into every group.

Output: a table (accuracy, steps to the `tools` run's peak, tool calls per episode and void episodes early and
late, step time), a PNG of accuracy and tool use against step, and results.json under the output directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import Field

from rlep.common.config import CONFIG_DIR, deep_merge, load_config
from rlep.common.curves import peak, steps_to_reach
from rlep.services.demo.runner import DemoConfig, demo_train_config
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.records import LogRecord, StepRecord
from rlep.services.learner.tool_rollouts import ToolUseConfig

TOOL_DEMO_CONFIG_FILE = CONFIG_DIR / "demo-tools.yaml"
ARMS = ("no tools", "tools", "tools + RLEP")
WINDOW = 10  # steps whose tool use is averaged, at the start and at the end of a run


class ToolDemoConfig(DemoConfig):
    """The miniature's sizes (DemoConfig's), the task's, the warm-up's mix and the tools of runs 2 and 3."""

    terms: int = Field(ge=2)
    """Numbers per question."""
    max_value: int = Field(ge=1)
    """Numbers are drawn from [1, max_value]."""
    tool_share: float = Field(gt=0, le=1)
    """Share of the tool runs' warm-up examples written as tool traces; the rest are worked solutions."""
    tools: ToolUseConfig
    """The tool loop and sandbox of runs 2 and 3 (and of the collection); the warm-up writes traces with its markers."""


def load_tool_demo_config(path: Path | None = None, sets: list[str] | None = None, flags: dict | None = None):
    """configs/demo-tools.yaml < `path` < env (`RLEP_DEMO_TOOLS__STEPS=20`) < `sets` < `flags` (None: unset)."""
    return load_config(ToolDemoConfig, path, flags, env_prefix="demo_tools", sets=sets, base=TOOL_DEMO_CONFIG_FILE)


def arm_config(demo: ToolDemoConfig, arm: str, model: Path, data: Path, eval_data: Path) -> TrainConfig:
    run_id = {"no tools": "no-tools", "tools": "tools", "tools + RLEP": "tools-rlep"}[arm]
    replayed = demo.replayed_per_question if arm == "tools + RLEP" else 0
    config = demo_train_config(demo, run_id, replayed, model, data, eval_data)
    if arm == "no tools":
        return config
    tools = {"tools": demo.tools.model_dump(mode="json")}
    return TrainConfig.model_validate(deep_merge(config.model_dump(mode="json", exclude_unset=True), tools))


def tool_use(records: list[LogRecord], first: bool) -> dict[str, float | None]:
    """Tool calls per episode and the share of void episodes over the first (or last) `WINDOW` steps."""
    steps = [r for r in records if isinstance(r, StepRecord)]
    steps = steps[:WINDOW] if first else steps[-WINDOW:]
    episodes = sum(sum((r.tool_finishes or {}).values()) for r in steps)
    if not episodes:
        return {"calls_per_episode": None, "void_share": None}
    calls = sum((r.tool_calls_mean or 0.0) * sum((r.tool_finishes or {}).values()) for r in steps)
    void = sum(r.tool_void_episodes or 0 for r in steps)
    return {"calls_per_episode": calls / episodes, "void_share": void / episodes}


def summarize(records: dict[str, list[LogRecord]]) -> dict:
    arms = {}
    for arm, runs in records.items():
        curve = [(r.step, r.eval_accuracy) for r in runs if r.eval_accuracy is not None]
        times = [r.step_seconds for r in runs if isinstance(r, StepRecord)]
        calls = [(r.step, r.tool_calls_mean) for r in runs if getattr(r, "tool_calls_mean", None) is not None]
        peak_step, best = peak(curve)
        arms[arm] = {
            "curve": curve,
            "start": curve[0][1],
            "peak": best,
            "peak_step": peak_step,
            "final": curve[-1][1],
            "calls_curve": calls,
            "early": tool_use(runs, first=True),
            "late": tool_use(runs, first=False),
            "step_seconds": sum(times) / len(times) if times else 0.0,
        }
    target = arms["tools"]["peak"]
    for arm in arms.values():
        arm["steps_to_tools_peak"] = steps_to_reach(arm["curve"], target)
    return {"arms": arms}


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (accuracy, calls) = plt.subplots(1, 2, figsize=(11, 4.2))
    for colour, (arm, figures) in enumerate(summary["arms"].items()):  # one colour per run in both panels
        steps, values = zip(*figures["curve"], strict=True)
        accuracy.plot(steps, values, marker="o", label=arm, color=f"C{colour}")
        if figures["calls_curve"]:
            steps, values = zip(*figures["calls_curve"], strict=True)
            calls.plot(steps, values, label=arm, color=f"C{colour}")
    accuracy.set_xlabel("training step")
    accuracy.set_ylabel("held-out accuracy (T=1)")
    calls.set_xlabel("training step")
    calls.set_ylabel("tool calls per training episode")
    for ax in (accuracy, calls):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_tool_demo(demo: ToolDemoConfig, show_progress: bool = True) -> dict:
    from rich.console import Console

    from rlep.common.ray_local import init_ray
    from rlep.common.tiny_model import cached_model
    from rlep.services.demo.task import make_problems, write_parquet
    from rlep.services.demo.warmup import WarmupConfig, warmup
    from rlep.services.launch.collection import collect_pool
    from rlep.services.launch.stack import ServiceStack
    from rlep.services.launch.training import run_training
    from rlep.services.learner.config import CollectConfig
    from rlep.services.learner.cursor import load_questions

    console = Console()
    out = demo.out_dir
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sizes = {"terms": demo.terms, "max_value": demo.max_value}
    train_data = write_parquet(make_problems(demo.train_questions, demo.seed, "train", **sizes), out / "train.parquet")
    eval_data = write_parquet(make_problems(demo.eval_questions, 0, "eval", **sizes), out / "eval.parquet")

    console.rule("1. supervised warm-ups: worked solutions only, and with tool traces")
    base = cached_model("tiny")
    plain = WarmupConfig(**sizes, eval_problems=0)  # every run's step-0 evaluation scores its start, tools and all
    mixed = plain.model_copy(update={"tool_share": demo.tool_share, "tool_loop": demo.tools.loop})
    warm = {
        "text": warmup(base, out / "warmup-text", demo.warmup_steps, demo.seed, plain, show_progress),
        "tools": warmup(base, out / "warmup-tools", demo.warmup_steps, demo.seed, mixed, show_progress),
    }
    console.print(f"warm-ups: {demo.warmup_steps} steps each, {sum(w.train_seconds for w in warm.values()):.0f}s")

    init_ray()
    configs = {
        arm: arm_config(demo, arm, warm["text" if arm == "no tools" else "tools"].out_dir, train_data, eval_data)
        for arm in ARMS
    }
    stack = ServiceStack(configs["tools"], warm["tools"].out_dir, app_name="rlep-demo-tools-rollout")
    services = stack.start(need_replay=True)
    pool = configs["tools"].replay_pool
    records: dict[str, list[LogRecord]] = {}
    try:
        if pool in services.replay.list_pools():
            services.replay.drop(pool, confirm=pool)
        for step, arm in enumerate(ARMS[:2], start=2):
            console.rule(f"{step}. {arm}: RL for {demo.steps} steps")
            records[arm] = []
            run_training(configs[arm], stack=stack, on_step=records[arm].append, show_progress=show_progress)
        console.rule("4. collect tool traces with the tools run's final policy")
        collect = CollectConfig(
            samples_per_question=demo.collect_samples,
            max_response_tokens=demo.max_response_tokens,
            seed=demo.seed,
            run_id="demo-tools-collect",
            # A tool trace is the same text every time it succeeds (the call copies the question): a question has
            # one distinct success, and the default bar of two kept 1 of 512 questions (97.9% of samples correct).
            min_successes=1,
        )
        final = out / "tools" / f"step_{demo.steps}" / "hf"
        stats = collect_pool(
            configs["tools"], final, load_questions([train_data]), pool, collect, stack, show_progress=show_progress
        )
        console.print(
            f"collected: {stats.questions_kept}/{stats.questions} questions kept, "
            f"success rate {stats.success_rate:.1%}, {stats.successes_stored} traces stored"
        )
        console.rule("5. tools + RLEP: replaying the traces, from the same warm-up")
        records["tools + RLEP"] = []
        run_training(configs["tools + RLEP"], stack=stack, on_step=records["tools + RLEP"].append,
                     show_progress=show_progress)  # fmt: skip
    finally:
        stack.close()
    summary = summarize(records)
    summary.update(
        seed=demo.seed,
        collect={"questions_kept": stats.questions_kept, "success_rate": stats.success_rate},
        warmup_seconds={name: w.train_seconds for name, w in warm.items()},
        total_seconds=time.perf_counter() - started,
        config=demo.model_dump(mode="json"),
    )
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    title = f"Tools on {demo.terms}-term sums, tiny Qwen2 (seed {demo.seed})"
    plot(summary, out / "accuracy.png", title)
    print_table(summary, console)
    console.print(f"plot: {out / 'accuracy.png'} · results: {out / 'results.json'}")
    return summary


def print_table(summary: dict, console) -> None:
    from rich.table import Table

    def share(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def reached(step: int | None) -> str:
        return "not reached" if step is None else str(step)

    arms = summary["arms"]
    table = Table(title="Tools and RLEP on 5-term sums (held-out accuracy, T=1; tool use of training episodes)")
    table.add_column("")
    for arm in arms:
        table.add_column(arm, justify="right")
    rows = {
        "accuracy at step 0": lambda a: share(a["start"], 3),
        "peak accuracy": lambda a: share(a["peak"], 3),
        "final accuracy": lambda a: share(a["final"], 3),
        "steps to the tools run's peak": lambda a: reached(a["steps_to_tools_peak"]),
        f"tool calls / episode, first {WINDOW} steps": lambda a: share(a["early"]["calls_per_episode"]),
        f"tool calls / episode, last {WINDOW} steps": lambda a: share(a["late"]["calls_per_episode"]),
        f"void episodes, first {WINDOW} steps": lambda a: share(a["early"]["void_share"], 3),
        f"void episodes, last {WINDOW} steps": lambda a: share(a["late"]["void_share"], 3),
        "mean step time (s)": lambda a: f"{a['step_seconds']:.2f}",
    }
    for name, cell in rows.items():
        table.add_row(name, *(cell(a) for a in arms.values()))
    console.print(table)
