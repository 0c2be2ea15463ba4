"""`rlep train`, `rlep collect` and `rlep demo` (registered on the main `rlep` app in services/cli/app.py)."""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from rlep.common.errors import UserError
from rlep.services.cli.errors import config_error

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
        raise config_error(err, TrainConfig) from err


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def model_problem(model: str) -> str | None:
    """What is wrong with `model` and the fix, when it is neither a preset nor an HF checkpoint directory here
    (config.json, weights and a tokenizer)."""
    from rlep.common.tiny_model import PRESETS

    path = Path(model)
    if model in PRESETS:
        return None
    presets = ", ".join(PRESETS)
    if path.is_file() and path.suffix == ".gguf":
        problem = "is a GGUF file; turn it into an HF directory with `rlep model import`"
    elif not path.is_dir():
        problem = "does not exist"
    elif not (path / "config.json").is_file():
        problem = "has no config.json, so it is not an HF checkpoint directory"
    elif not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        problem = f"has no weights ({' or '.join(WEIGHT_FILES)})"
    elif not any((path / name).is_file() for name in TOKENIZER_FILES):
        problem = f"has no tokenizer ({', '.join(TOKENIZER_FILES)})"
    else:
        return None
    return (
        f"model `{model}` {problem}\n"
        f"give an HF checkpoint directory (`rlep model import` makes one from a GGUF file) or a preset: {presets}"
    )


def check_train_files(files: list[Path], read_schema: bool = True) -> None:
    """Refuses no training files or a missing one; with `read_schema`, one without the verl columns too."""
    from rlep.common.dataset import DatasetError, read_verl_parquet

    if not files:
        raise UserError(
            "no training data given; pass --data FILE (a verl parquet), or a --config with data.train_files"
        )
    for path in files:
        if problem := file_problem(path, "--data (config: data.train_files)"):
            raise UserError(f"training file {path} {problem}")
        if path.suffix in (".jsonl", ".json"):
            raise UserError(f"training file {path} is JSON lines; --data takes a {VERL_PARQUET}")
        try:
            if read_schema:
                read_verl_parquet(path, limit=1)
        except DatasetError as err:
            raise UserError(f"{shorten(str(err))}; give a {VERL_PARQUET}") from err


VERL_PARQUET = "verl parquet file (`prompt`, `reward_model.ground_truth` columns)"
QUOTE_CHARS = 300  # a library's reason quoted in a one-line message (pyarrow's can run to a whole schema)


def shorten(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` on one line, cut to `limit` characters with `...` where it was cut."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def file_problem(path: Path, setting: str) -> str | None:
    """Why `path` is no data file (missing, a folder) and the fix naming `setting`, or None when it is a file."""
    if path.is_dir():
        return f"is a folder; {setting} takes a {VERL_PARQUET} each, e.g. one of the folder's *.parquet files"
    if not path.is_file():
        return f"does not exist; fix {setting}"
    return None


def _require_tracking(config) -> None:
    """Fails before any service starts when W&B is asked for and not installed."""
    from rlep.services.learner.tracking import check_wandb_installed

    try:
        check_wandb_installed(config.logging.wandb)
    except RuntimeError as err:
        raise UserError(str(err)) from err


ModelOpt = Annotated[str | None, typer.Option(help="HF checkpoint directory or tiny-model preset (config: model).")]
DataOpt = Annotated[
    list[Path] | None, typer.Option(help="verl/DAPO parquet of the training questions (config: data.train_files).")
]


def check_paths(config) -> None:
    """The model and every data file the run reads exist and look right, named when they do not (UserError)."""
    if problem := model_problem(config.model):
        raise UserError(problem)
    check_train_files(config.data.train_files)
    if config.eval.every_steps:
        for path in config.eval.files:
            if problem := file_problem(Path(path), "eval.files"):
                raise UserError(f"eval file {path} {problem}")


def check_lora_targets(config) -> None:
    """With LoRA on, every `lora.target_modules` name is a module of the model (UserError naming the ones it has),
    read from the model's structure without its weights before Ray and the services start."""
    if not config.lora.enabled:
        return
    from rlep.common.tiny_model import resolve_model
    from rlep.services.learner.lora import model_skeleton, target_problem

    if problem := target_problem(model_skeleton(resolve_model(config.model)), config.lora):
        raise UserError(problem)


def check_resume(config) -> str | None:
    """`--resume` finds a checkpoint to continue from, saved with the LoRA shape the config asks for (UserError):
    it continues a run, and a fresh start in its place would write step 1 again over that run's log and checkpoints
    (the Helm Job passes it only when there is one). Checked before Ray and the services start; the trainer would
    only find out once they are up (162 s, then a 504-line traceback for another LoRA shape). Returns the line to
    print when the run has already trained its `steps`: nothing to start."""
    from rlep.services.learner.checkpoint_info import latest_checkpoint, shape_problem

    ckpt = config.checkpoint.dir
    if ckpt is None:
        raise UserError("--resume: checkpoint.dir is not set, so there is no checkpoint; set it, or drop --resume")
    try:
        latest = latest_checkpoint(ckpt)
    except ValueError as err:
        raise UserError(f"--resume: {err}") from None
    if latest is None:
        raise UserError(f"--resume: no checkpoint in {ckpt} (no `latest`); drop --resume to start from step 0")
    if problem := shape_problem(latest, config):
        raise UserError(problem)
    if latest.step >= config.steps:
        return (
            f"--resume: {ckpt} is at step {latest.step} and this run trains {config.steps} steps: nothing to do "
            f"(raise --steps to train further)"
        )
    return None


def check_scorers_of(config) -> None:
    """The Python scorers of the verifier the run starts import from `verifier.scorer_path` and take (response,
    ground_truth, extra), checked here in one line rather than by the verifier after Ray and vLLM have started."""
    if config.endpoints.verifier:
        return
    from rlep.services.verifier.python_scorer import check_scorers

    try:
        check_scorers(config.verifier)
    except ValueError as err:
        raise UserError(f"verifier: {err}") from None


def check_before_start(config, resume: bool) -> str | None:
    """What `rlep train` checks before Ray and the services start (each a UserError naming the fix); returns the
    line to print instead of training when a resumed run has nothing left to do."""
    check_paths(config)
    check_scorers_of(config)
    check_lora_targets(config)
    return check_resume(config) if resume else None


def what_will_run(config):
    """`config` as the run will use it: the replicas it starts serve `model` (the stack puts it there at start)."""
    started_here = not (config.endpoints.rollout or config.endpoints.rollout_service)
    if not started_here:
        return config
    engine = config.local.rollout_engine.model_copy(update={"model": config.model})
    return config.model_copy(update={"local": config.local.model_copy(update={"rollout_engine": engine})})


def train(
    config: ConfigOpt = None,
    model: ModelOpt = None,
    data: DataOpt = None,
    pool: Annotated[str | None, typer.Option(help="Replay pool of phase-1 successes (config: replay_pool).")] = None,
    steps: Annotated[int | None, typer.Option(help="Training steps (config: steps).", min=0)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint.")] = False,
    ray_address: RayOpt = None,
    set_: SetOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config, check the model and data paths, and exit.")
    ] = False,
    skip_path_checks: Annotated[
        bool, typer.Option("--skip-path-checks", help="With --dry-run: a config for another machine (a pod's volumes).")
    ] = False,
) -> None:
    """Train with RLEP (or the M=0 baseline) over rollout, verifier and replay; starts what is not given.

    Without --config the defaults are RLEP's paper recipe (512 questions x 16 samples x 3072 tokens per step):
    `--config configs/train.yaml` sizes it for a CPU machine."""
    flags = {"model": model, "replay_pool": pool, "steps": steps}
    flags["data.train_files"] = [str(p) for p in data] if data else None
    resolved = load_train_config(config, set_, flags)
    if dry_run:
        from rlep.common.config import dump_config_json

        if not skip_path_checks:  # first: a refusal is one line, not the last line after the 170 of the config
            check_before_start(resolved, resume)
        typer.echo(dump_config_json(what_will_run(resolved)))
        return
    if finished := check_before_start(resolved, resume):
        typer.echo(finished)
        return
    _require_tracking(resolved)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # What the run started and where (the replicas' /metrics, the dtypes, the scorers' routes): a line each.
    logging.getLogger("rlep.services.launch").setLevel(logging.INFO)
    from rlep.services.launch.training import run_training

    try:
        records = run_training(resolved, resume=resume, ray_address=ray_address)
    except KeyboardInterrupt:
        typer.echo(interrupted_line(resolved), err=True)
        raise typer.Exit(130) from None
    if records:
        last = records[-1]
        typer.echo(
            f"step {last.step}: fresh accuracy {last.fresh_accuracy:.3f}, reward {last.reward_mean:+.3f}, "
            f"policy version {last.policy_version}"
        )


def interrupted_line(config, argv: list[str] | None = None) -> str:
    """What a Ctrl-C of `rlep train` prints: the command that resumes, or why nothing can be resumed."""
    import shlex
    import sys

    from rlep.services.learner.checkpoint_info import latest_checkpoint

    ckpt = config.checkpoint.dir
    try:
        latest = latest_checkpoint(ckpt) if ckpt is not None else None
    except ValueError:
        latest = None
    if latest is None:
        where = "checkpoint.dir is not set" if ckpt is None else f"no checkpoint was written in {ckpt} yet"
        return f"interrupted: {where}, so a rerun starts from step 0"
    args = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["rlep", *args, *([] if "--resume" in args else ["--resume"])])
    return f"interrupted; {ckpt} holds step {latest.step}. To continue from it: {command}"


def _collect_config(config: Path | None, sets: list[str] | None, flags: dict):
    """The TrainConfig `rlep collect` runs with: defaults < file < env < --set < the named flags."""
    resolved = load_train_config(config, sets, flags)
    if not resolved.data.train_files:
        raise UserError("no training questions given; pass --data FILE or set data.train_files in the --config file")
    check_train_files(resolved.data.train_files, read_schema=False)  # read by `collect` as it loads the questions
    if problem := model_problem(resolved.model):
        raise UserError(problem)
    check_scorers_of(resolved)
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

    from rlep.common.tiny_model import resolve_model
    from rlep.services.launch.collection import collect_pool
    from rlep.services.learner.collect import StateMismatch, default_state_file, load_state, run_settings
    from rlep.services.learner.cursor import load_questions

    flags = {"model": model, "replay_pool": pool, "data.train_files": [str(p) for p in data or []] or None}
    flags |= {"collect.samples_per_question": n, "collect.temperature": temperature, "collect.top_p": top_p}
    flags |= {"collect.max_response_tokens": max_tokens, "collect.min_successes": min_successes}
    train_config = _collect_config(config, set_, flags)
    _require_tracking(train_config)
    model_dir = Path(resolve_model(train_config.model))
    check_train_files(train_config.data.train_files)  # the missing column named, not a traceback
    questions = load_questions(train_config.data.train_files)
    pool_name, collect_config = train_config.replay_pool, train_config.collect
    settings = run_settings(collect_config, questions, pool_name, model_dir)
    state_file = state_file or default_state_file(pool_name, settings)
    try:  # refuse before starting any service: an engine takes minutes to come up
        done = load_state(state_file, settings).chunks_done
    except StateMismatch as err:
        raise typer.BadParameter(str(err), param_hint="--state-file") from err
    typer.echo(f"progress file {state_file}" + (f" ({done} chunks done: resuming)" if done else ""))
    stats = collect_pool(
        train_config, model_dir, questions, pool_name, collect_config, ray_address=ray_address, state_file=state_file
    )
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


class DemoTask(StrEnum):
    sums = "sums"
    tools = "tools"


def demo(
    task: Annotated[
        DemoTask,
        typer.Option(
            help="sums: RLEP against the baseline (configs/demo.yaml); tools: the tool demo, three runs "
            "(configs/demo-tools.yaml)."
        ),
    ] = DemoTask.sums,
    seed: Annotated[int | None, typer.Option(help="Seed of every phase (config: seed).")] = None,
    out_dir: Annotated[Path | None, typer.Option(help="Output folder (config: out_dir).")] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Demo settings YAML, read over the task's.", exists=True),
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override any setting: --set steps=20")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved settings and exit.")] = False,
) -> None:
    """The main job on the embedded default: warm-up, baseline RL, collection, RLEP, and the comparison."""
    from rlep.common.config import dump_config_json

    if task is DemoTask.tools:
        from rlep.services.demo.tool_runner import ToolDemoConfig as Config
        from rlep.services.demo.tool_runner import load_tool_demo_config as load
        from rlep.services.demo.tool_runner import run_tool_demo as run
    else:
        from rlep.services.demo.runner import DemoConfig as Config
        from rlep.services.demo.runner import load_demo_config as load
        from rlep.services.demo.runner import run_demo as run
    try:
        resolved = load(config, set_, {"seed": seed, "out_dir": out_dir})
    except ValueError as err:
        raise config_error(err, Config) from err
    if dry_run:
        typer.echo(dump_config_json(resolved))
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(resolved)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("collect")(collect)
    app.command("demo")(demo)
