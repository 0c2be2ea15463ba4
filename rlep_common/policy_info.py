"""What a trained checkpoint's HF export says about itself: `rlep-policy.json`, beside its weights.

The learner writes one into every `<checkpoint.dir>/step_N/hf/` (services/learner/trainer.py): the run, the
training step, and the policy version those weights were pushed to rollout as (the `policy_version` of step N's
record). A rollout that `rlep train`, `rlep collect` or the demo starts from such a directory serves it as that
version (services/launch/stack.py), so answers sampled from a trained checkpoint carry the version that produced
them instead of 0, and a run started from it numbers its versions on from there. Directories without the file
(a base model, `rlep model import`'s output) are version 0.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["POLICY_FILE", "policy_version_of", "read_policy_info", "write_policy_info"]

POLICY_FILE = "rlep-policy.json"


def write_policy_info(hf_dir: Path, run_id: str, step: int, policy_version: int) -> Path:
    """Writes `hf_dir/rlep-policy.json`; returns its path."""
    path = Path(hf_dir) / POLICY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"run_id": run_id, "step": step, "policy_version": policy_version}
    path.write_text(json.dumps(info, indent=1) + "\n")
    return path


def read_policy_info(model_dir: Path | str) -> dict | None:
    """The info a checkpoint directory records, or None when it records none (or `model_dir` is no directory)."""
    path = Path(model_dir) / POLICY_FILE
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
        int(info["policy_version"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not an RLEP policy file ({err})") from err
    return info


def policy_version_of(model_dir: Path | str) -> int:
    """The policy version a checkpoint directory's weights were trained to (0 when it records none)."""
    info = read_policy_info(model_dir)
    return int(info["policy_version"]) if info else 0
