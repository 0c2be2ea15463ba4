"""`rlep train`, `rlep collect` and `rlep demo` (registered on the main `rlep` app in rlep_common/cli.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="Training config YAML.", exists=True)]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override any field: --set algorithm.replayed_per_question=0")
]
RayOpt = Annotated[str | None, typer.Option("--ray-address", help="Join this Ray cluster instead of starting one.")]


def load_train_config(config: Path | None, sets: list[str] | None):
    from rlep_common.config import load_config, parse_override
    from services.learner.config import TrainConfig

    try:
        return load_config(TrainConfig, config, dict(parse_override(s) for s in sets or []), env_prefix="train")
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
        typer.echo(json.dumps(resolved.model_dump(mode="json"), indent=2))
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.learner.main import run_training

    records = run_training(resolved, resume=resume, ray_address=ray_address)
    if records:
        last = records[-1]
        typer.echo(
            f"step {last['step']}: fresh accuracy {last['fresh_accuracy']:.3f}, reward {last['reward_mean']:+.3f}, "
            f"policy version {last['policy_version']}"
        )


def collect(
    model: Annotated[str, typer.Option(help="Checkpoint directory (or tiny-model preset) to sample from.")],
    data: Annotated[list[Path], typer.Option(help="verl/DAPO parquet with the training questions.", exists=True)],
    pool: Annotated[str, typer.Option(help="Replay pool to fill.")],
    n: Annotated[int, typer.Option(help="Samples per question.")] = 64,
    temperature: float = 0.7,
    top_p: float = 0.95,
    max_tokens: Annotated[int, typer.Option(help="Max new tokens per sample.")] = 20480,
    min_successes: Annotated[int, typer.Option(help="Keep questions with at least this many successes.")] = 2,
    state_file: Annotated[Path | None, typer.Option(help="Progress file; rerun to resume.")] = None,
    config: ConfigOpt = None,
    ray_address: RayOpt = None,
    set_: SetOpt = None,
) -> None:
    """Phase 1 of RLEP: sample N answers per question with a trained policy and store the verified ones."""
    logging.basicConfig(level=logging.WARNING)
    from rich.console import Console
    from rich.table import Table

    from services.learner.collect import CollectConfig, push_checkpoint
    from services.learner.collect import collect as run_collect
    from services.learner.data import load_questions
    from services.learner.launch import LocalStack, init_ray
    from services.rollout.engine import resolve_model

    train_config = load_train_config(config, set_)
    model_dir = Path(resolve_model(model))
    questions = load_questions(data)
    init_ray(ray_address)
    stack = LocalStack(train_config, model_dir)
    services = stack.start(need_replay=True)
    try:
        if train_config.endpoints.rollout:
            push_checkpoint(services.rollout, model_dir)
        stats = run_collect(
            services,
            questions,
            pool,
            CollectConfig(
                samples_per_question=n,
                temperature=temperature,
                top_p=top_p,
                max_response_tokens=max_tokens,
                min_successes=min_successes,
                seed=train_config.seed,
            ),
            state_file=state_file or Path.home() / ".cache" / "rlep" / "collect" / f"{pool}.json",
        )
    finally:
        stack.close()
    table = Table(title=f"collected into pool {pool!r}")
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
    seed: Annotated[int, typer.Option(help="Seed of the data, the warm-up and both RL runs.")] = 0,
    out_dir: Annotated[Path, typer.Option(help="Where checkpoints, results.json and accuracy.png go.")] = Path(
        "rlep-demo"
    ),
    set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved settings and exit.")] = False,
) -> None:
    """The main job on the embedded default: warm-up, baseline RL, collection, RLEP, and the comparison."""
    from rlep_common.config import parse_override
    from services.learner.demo import DemoConfig

    overrides = dict(parse_override(s) for s in set_ or [])
    try:
        config = DemoConfig.model_validate({"seed": seed, "out_dir": str(out_dir), **overrides})
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if dry_run:
        typer.echo(json.dumps(config.model_dump(mode="json"), indent=2))
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.learner.demo import run_demo

    run_demo(config)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("collect")(collect)
    app.command("demo")(demo)
