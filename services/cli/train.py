"""`rlep train`, `rlep collect` and `rlep demo` (registered on the main `rlep` app in services/cli/app.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="Training config YAML.", exists=True)]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override any field: --set algorithm.replayed_per_question=0")
]
RayOpt = Annotated[str | None, typer.Option("--ray-address", help="Join this Ray cluster instead of starting one.")]


def load_train_config(config: Path | None, sets: list[str] | None, flags: dict | None = None):
    """defaults < file < env < --set < `flags` (dotted paths of named options; None = not given)."""
    from rlep.common.config import load_config
    from rlep.services.learner.config import TrainConfig

    try:
        return load_config(TrainConfig, config, flags, env_prefix="train", sets=sets)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err


def train(
    config: ConfigOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint.")] = False,
    ray_address: RayOpt = None,
    set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and exit.")] = False,
) -> None:
    """Train with RLEP (or the M=0 baseline) over rollout, verifier and replay; starts what is not given."""
    resolved = load_train_config(config, set_)
    if dry_run:
        from rlep.common.config import dump_config_json

        typer.echo(dump_config_json(resolved))
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlep.services.cli.run import run_training

    records = run_training(resolved, resume=resume, ray_address=ray_address)
    if records:
        last = records[-1]
        typer.echo(
            f"step {last.step}: fresh accuracy {last.fresh_accuracy:.3f}, reward {last.reward_mean:+.3f}, "
            f"policy version {last.policy_version}"
        )


def _collect_config(config: Path | None, sets: list[str] | None, flags: dict):
    """The TrainConfig `rlep collect` runs with: defaults < file < env < --set < the named flags."""
    resolved = load_train_config(config, sets, flags)
    if not resolved.data.train_files:
        raise typer.BadParameter("no training questions: pass --data or set data.train_files in the --config file")
    missing = [str(path) for path in resolved.data.train_files if not path.exists()]
    if missing:
        raise typer.BadParameter(f"data.train_files: {', '.join(missing)} not found")
    return resolved


def collect(
    model: Annotated[
        str | None, typer.Option(help="Checkpoint directory or tiny-model preset (config: model).")
    ] = None,
    data: Annotated[
        list[Path] | None,
        typer.Option(help="verl/DAPO parquet of the questions (config: data.train_files).", exists=True),
    ] = None,
    pool: Annotated[str | None, typer.Option(help="Replay pool to fill (config: replay_pool).")] = None,
    n: Annotated[int | None, typer.Option(help="Samples per question (config: collect.samples_per_question).")] = None,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature (config: collect.temperature).")
    ] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus threshold (config: collect.top_p).")] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Max new tokens (config: collect.max_response_tokens).")
    ] = None,
    min_successes: Annotated[
        int | None, typer.Option(help="Keep questions with this many successes (config: collect.min_successes).")
    ] = None,
    state_file: Annotated[
        Path | None,
        typer.Option(
            help="Progress file; rerun with the same settings to resume (default: ~/.cache/rlep/collect/POOL-FP.json)."
        ),
    ] = None,
    config: ConfigOpt = None,
    ray_address: RayOpt = None,
    set_: SetOpt = None,
) -> None:
    """Phase 1 of RLEP: sample N answers per question with a trained policy and store the verified ones.

    Progress is kept per pool and settings (checkpoint, questions, collect.*): a rerun with the same ones resumes,
    other settings get their own default state file, and an explicit --state-file of other settings is refused.
    """
    logging.basicConfig(level=logging.WARNING)
    from rich.console import Console
    from rich.table import Table

    from rlep.common.ray_local import init_ray
    from rlep.common.tiny_model import resolve_model
    from rlep.services.cli.stack import ServiceStack
    from rlep.services.learner.collect import (
        StateMismatch,
        default_state_file,
        load_state,
        push_checkpoint,
        run_settings,
    )
    from rlep.services.learner.collect import collect as run_collect
    from rlep.services.learner.data import load_questions
    from rlep.services.learner.tokens import PolicyTokenizer

    flags = {"model": model, "replay_pool": pool, "data.train_files": [str(p) for p in data or []] or None}
    flags |= {"collect.samples_per_question": n, "collect.temperature": temperature, "collect.top_p": top_p}
    flags |= {"collect.max_response_tokens": max_tokens, "collect.min_successes": min_successes}
    train_config = _collect_config(config, set_, flags)
    model_dir = Path(resolve_model(train_config.model))
    questions = load_questions(train_config.data.train_files)
    pool_name, collect_config = train_config.replay_pool, train_config.collect
    settings = run_settings(collect_config, questions, pool_name, model_dir)
    state_file = state_file or default_state_file(pool_name, settings)
    try:  # refuse before starting any service: an engine takes minutes to come up
        done = load_state(state_file, settings).chunks_done
    except StateMismatch as err:
        raise typer.BadParameter(str(err), param_hint="--state-file") from err
    typer.echo(f"progress file {state_file}" + (f" ({done} chunks done: resuming)" if done else ""))
    init_ray(ray_address)
    stack = ServiceStack(train_config, model_dir)
    services = stack.start(need_replay=True)
    try:
        if train_config.endpoints.rollout or train_config.endpoints.rollout_service:
            push_checkpoint(services.rollout, model_dir)
        tokenizer = PolicyTokenizer.load(
            model_dir, train_config.data.max_prompt_tokens, collect_config.max_response_tokens
        )
        stats = run_collect(
            services,
            questions,
            pool_name,
            collect_config,
            state_file=state_file,
            checkpoint=model_dir,
            tokenizer=tokenizer,
        )
    finally:
        stack.close()
    table = Table(title=f"collected into pool {pool_name!r}")
    for column in ("questions", "kept (>= k successes)", "samples", "success rate", "successes stored", "seconds"):
        table.add_column(column, justify="right")
    table.add_row(
        str(stats.questions),
        str(stats.questions_kept),
        str(stats.samples),
        f"{stats.success_rate:.1%}",
        str(stats.successes_stored),
        f"{stats.seconds:.0f}",
    )
    Console().print(table)


def demo(
    seed: Annotated[int | None, typer.Option(help="Seed of every phase (config: seed).")] = None,
    out_dir: Annotated[Path | None, typer.Option(help="Output folder (config: out_dir).")] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Demo settings YAML, read over configs/demo.yaml.", exists=True),
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override any setting: --set steps=20")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved settings and exit.")] = False,
) -> None:
    """The main job on the embedded default: warm-up, baseline RL, collection, RLEP, and the comparison."""
    from rlep.common.config import dump_config_json
    from rlep.services.cli.demo import load_demo_config

    try:
        resolved = load_demo_config(config, set_, {"seed": seed, "out_dir": out_dir})
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if dry_run:
        typer.echo(dump_config_json(resolved))
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlep.services.cli.demo import run_demo

    run_demo(resolved)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("collect")(collect)
    app.command("demo")(demo)
