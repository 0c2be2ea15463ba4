"""Experiment tracking: the step records of `rlep train` (and the chunk progress of `rlep collect`) as
TensorBoard scalars and Weights & Biases metrics, beside the JSONL log and the Prometheus gauges.

A `StepSink` takes one record per step as its JSON form (`StepRecord.to_json()`, the JSONL line), so the
names are the JSONL keys: nested fields are joined with `/` (`phase_seconds/rollout`,
`replay_dropped/<reason>`), non-numeric fields (`question_ids`) and absent ones (`eval_accuracy` on steps
without an evaluation) are left out, and `step` is the x-axis rather than a series. The resolved config is
the run's hyper-parameters (TensorBoard: the HPARAMS tab and a `config` text summary; W&B: `config=`).
A few of each step's responses go to a sink as a table (`generations`: TensorBoard text, a W&B table).

`torch.utils.tensorboard` and `wandb` are imported only when a sink of theirs is made.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rlep.common.config import redact_secrets
from rlep.services.learner.config import LoggingConfig, TrainConfig, WandbConfig
from rlep.services.learner.generation_log import LoggedGeneration, markdown_table

__all__ = [
    "StepSink",
    "TensorBoardSink",
    "WandbSink",
    "check_wandb_installed",
    "flatten_numbers",
    "run_dir",
    "setup_step_sinks",
    "tensorboard_dir",
]

WANDB_MISSING = "logging.wandb.project is set but wandb is not installed: pip install 'rlep[wandb]'"


class StepSink(Protocol):
    """Where a run's step records go besides the JSONL log."""

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        """Logs one record (a JSONL line as a dict) at `step`."""

    def write_generations(self, step: int, rows: Sequence[LoggedGeneration]) -> None:
        """Logs a few of the step's sampled responses as a table (`generation_log.pick`)."""

    def close(self) -> None:
        """Flushes and releases the sink (the run ended or failed)."""


def flatten_numbers(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of `record` by `/`-joined name; strings, lists and None are left out.

    Args:
        record: a JSON-like dict, e.g. `{"loss": 0.5, "phase_seconds": {"train": 1.2}, "question_ids": [...]}`.
    Returns:
        `{"loss": 0.5, "phase_seconds/train": 1.2}`.
    """
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten_numbers(value, f"{name}/")
        elif isinstance(value, numbers.Real):  # bools included, as 0/1
            flat[name] = float(value)
    return flat


def hparams(config: TrainConfig) -> dict[str, Any]:
    """The resolved config, secrets masked, as the nested JSON dict `--dry-run` prints."""
    return redact_secrets(config.model_dump(mode="json"))


def _scalar_hparams(config: Mapping[str, Any], prefix: str = "") -> dict[str, int | float | str | bool]:
    """Flat `/`-joined config values TensorBoard's HPARAMS tab takes (lists and None as JSON text)."""
    flat: dict[str, int | float | str | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= _scalar_hparams(value, f"{name}/")
        else:
            flat[name] = value if isinstance(value, int | float | str | bool) else json.dumps(value)
    return flat


class TensorBoardSink:
    """Scalars per step in `log_dir`; the config as hparams and as a `config` text summary of its JSON."""

    def __init__(self, log_dir: Path, config: Mapping[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self._session_end = None
        if config is not None:
            self.writer.add_text("config", f"```json\n{json.dumps(config, indent=2)}\n```")
            # In this run's own folder (SummaryWriter.add_hparams would open another one per call).
            experiment, session_start, self._session_end = hparams_summary(_scalar_hparams(config), {})
            for summary in (experiment, session_start):
                self.writer.file_writer.add_summary(summary)

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        for name, value in flatten_numbers(record).items():
            if name != "step":
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def write_generations(self, step: int, rows: Sequence[LoggedGeneration]) -> None:
        self.writer.add_text("generations", markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        if self._session_end is not None:
            self.writer.file_writer.add_summary(self._session_end)
        self.writer.close()


class WandbSink:
    """One W&B run: the config as `config=`, each record as `run.log(..., step=step)`."""

    def __init__(self, config: WandbConfig, name: str, job_type: str, folder: Path | None, hyper: Mapping[str, Any]):
        check_wandb_installed(config)
        import wandb

        folder = config.dir or folder
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=name,
            job_type=job_type,
            mode=config.mode,
            dir=str(folder) if folder is not None else None,
            config=dict(hyper),
        )

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        metrics = {name: value for name, value in flatten_numbers(record).items() if name != "step"}
        self.run.log(metrics, step=step)

    def write_generations(self, step: int, rows: Sequence[LoggedGeneration]) -> None:
        import wandb

        columns = list(LoggedGeneration.__dataclass_fields__)
        table = wandb.Table(columns=columns, data=[[getattr(r, c) for c in columns] for r in rows])
        self.run.log({"generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def check_wandb_installed(config: WandbConfig) -> None:
    """Raises RuntimeError (one line) when W&B is asked for and `wandb` cannot be imported."""
    from importlib.util import find_spec

    if config.project is not None and find_spec("wandb") is None:
        raise RuntimeError(WANDB_MISSING)


def run_dir(config: TrainConfig) -> Path | None:
    """The run's directory: `checkpoint.dir`, else the folder of `log_file`, else None."""
    if config.checkpoint.dir is not None:
        return config.checkpoint.dir
    return config.log_file.parent if config.log_file is not None else None


def tensorboard_dir(config: TrainConfig, job: str = "train") -> Path | None:
    """Where `job`'s event files go (`LoggingConfig.tensorboard_dir`); None = no TensorBoard."""
    tracking: LoggingConfig = config.logging
    folder = run_dir(config)
    base = tracking.tensorboard_dir or (folder / "tensorboard" if folder is not None else None)
    if not tracking.tensorboard or base is None:
        return None
    return base if job == "train" else base / job


def setup_step_sinks(config: TrainConfig, job: str = "train") -> list[StepSink]:
    """The TensorBoard and W&B sinks `config.logging` asks for (`job`: train or collect)."""
    hyper = hparams(config)
    sinks: list[StepSink] = []
    wandb = config.logging.wandb
    if wandb.project is not None:  # first: the likelier one to fail, before a writer is left open
        name = config.run_id if job == "train" else config.collect.run_id
        sinks.append(WandbSink(wandb, name, job, run_dir(config), hyper))
    if (folder := tensorboard_dir(config, job)) is not None:
        sinks.append(TensorBoardSink(folder, hyper))
    return sinks
