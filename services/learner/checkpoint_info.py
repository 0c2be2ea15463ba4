"""What a checkpoint was trained with, read back before a `--resume` starts anything (issue 47 item 3).

Each `step_N/` directory gets `rlep-checkpoint.json`: its step and the settings that fix the shape of the saved
state (full fine-tuning or LoRA, and the adapters' rank and target modules). `rlep train --resume` compares them
with the config before Ray and the services start: a resume with another LoRA shape ended in a 504-line traceback
after 162 s of start-up, and the resume of a finished run started the whole stack to do nothing.

Checkpoints written before this file existed have none: only their step (from the `latest` tag) is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlep.common.atomic_file import atomic_write
from rlep.services.learner.config import TrainConfig

INFO_FILE = "rlep-checkpoint.json"


def shape_of(config: TrainConfig) -> dict:
    """The settings a checkpoint's saved state depends on: LoRA's rank and targets (rank 0: every weight)."""
    lora = config.lora
    return {"lora_rank": lora.rank, "lora_target_modules": sorted(lora.target_modules) if lora.enabled else []}


def write_checkpoint_info(step_dir: Path, config: TrainConfig, step: int) -> Path:
    path = Path(step_dir) / INFO_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, 0o644) as file:
        file.write((json.dumps({"step": step, "model": config.model, **shape_of(config)}, indent=1) + "\n").encode())
    return path


@dataclass(frozen=True)
class LatestCheckpoint:
    tag: str
    step: int
    info: dict | None
    """`rlep-checkpoint.json` of the step, None for a checkpoint written before it existed."""


def latest_checkpoint(ckpt_dir: Path) -> LatestCheckpoint | None:
    """The checkpoint `latest` names (None without one); ValueError when `latest` or the info file is unreadable."""
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    if not tag.startswith("step_") or not tag[5:].isdigit():
        raise ValueError(f"{latest} names {tag[:80]!r}, not a step_N checkpoint")
    path = Path(ckpt_dir) / tag / INFO_FILE
    info = None
    if path.is_file():
        try:
            info = json.loads(path.read_text())
            int(info["step"]), int(info["lora_rank"]), list(info["lora_target_modules"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: not an RLEP checkpoint info file ({err})") from err
    return LatestCheckpoint(tag, int(tag[5:]), info)


def describe(shape: dict) -> str:
    if not shape["lora_rank"]:
        return "full fine-tuning (lora.rank=0)"
    return f"LoRA rank {shape['lora_rank']} on {', '.join(shape['lora_target_modules'])}"


def shape_problem(latest: LatestCheckpoint, config: TrainConfig) -> str | None:
    """Why the checkpoint's saved state does not fit `config`, with the settings that would, or None."""
    if latest.info is None:
        return None
    saved = {key: latest.info[key] for key in ("lora_rank", "lora_target_modules")}
    if saved == shape_of(config):
        return None
    fix = f"--set lora.rank={saved['lora_rank']}"
    if saved["lora_rank"]:
        fix += f" --set 'lora.target_modules=[{', '.join(saved['lora_target_modules'])}]'"
    return (
        f"--resume: {latest.tag} in {config.checkpoint.dir} was trained with {describe(saved)}, this config asks for "
        f"{describe(shape_of(config))}; resume with {fix}, or start a new run in another checkpoint.dir"
    )
