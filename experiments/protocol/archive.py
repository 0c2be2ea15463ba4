"""Finished protocol runs kept in the repository, so a protocol longer than one machine's life resumes on another.

`work_dir` (runs/, not committed) holds everything a run writes; the archive (committed, `ProtocolConfig.archive`)
holds what a rerun elsewhere needs and could not rebuild identically there:
- `results/<run id>.json`: each finished run's result.json (its curve, steps, costs);
- `pools/<pool>.json`: each collection's figures;
- `models/<name>/`: the HF checkpoints the remaining work starts from — the shared warm-up every run starts
  from (a warm-up rebuilt on another CPU differs in its last bits, and pairs must share one), and the first
  baseline's final and half-way checkpoints the pools are collected from (4 MB each for the tiny model).
A pool itself is not archived: where the replay service lacks it, it is collected again from its archived
checkpoint (same seed, same settings; vLLM's sampling on another CPU may pick other successes), and its figures
are taken from that collection.
"""

from __future__ import annotations

import shutil
from pathlib import Path

HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
HF_FILES_OPTIONAL = ("chat_template.jinja", "rlep_model_spec.json", "warmup.json")


def save_file(archive: Path, name: str, source: Path) -> None:
    """Keeps `source` as `name` under the archive (e.g. "results/baseline-s0.json")."""
    _copy(source, archive / name)


def restore_file(archive: Path, name: str, target: Path) -> bool:
    """Puts the archived `name` at `target` when `target` is missing; False when neither exists."""
    if target.exists():
        return True
    if not (archive / name).exists():
        return False
    _copy(archive / name, target)
    return True


def save_checkpoint(archive: Path, name: str, hf_dir: Path) -> None:
    for file in HF_FILES + HF_FILES_OPTIONAL:
        if (hf_dir / file).exists():
            _copy(hf_dir / file, archive / "models" / name / file)


def restore_checkpoint(archive: Path, name: str, hf_dir: Path) -> bool:
    """Puts the archived checkpoint `name` at `hf_dir` when it is missing there; False when neither exists."""
    if (hf_dir / "model.safetensors").exists():
        return True
    source = archive / "models" / name
    if not (source / "model.safetensors").exists():
        return False
    for file in source.iterdir():
        _copy(file, hf_dir / file.name)
    return True


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


def archive_finished(archive: Path, work_dir: Path, warmup_dir: Path, first_baseline: str, half_step) -> list[str]:
    """Archives whatever has finished under `work_dir` (runs, pool figures, the warm-up, the first baseline's final and
    half-way checkpoints); returns what it saved. `half_step(steps)` is the half-way checkpoint's step."""
    import json

    saved = []
    if (warmup_dir / "model.safetensors").exists():
        save_checkpoint(archive, "warmup", warmup_dir)
        saved.append("models/warmup")
    for result in sorted(work_dir.glob("*/result.json")):
        save_file(archive, f"results/{result.parent.name}.json", result)
        saved.append(f"results/{result.parent.name}.json")
        if result.parent.name == first_baseline:
            steps = json.loads(result.read_text())["steps"]
            for step in (steps, half_step(steps)):
                name = f"{first_baseline}-step_{step}"
                save_checkpoint(archive, name, result.parent / f"step_{step}" / "hf")
                saved.append(f"models/{name}")
    for figures in sorted(work_dir.glob("pool-*.json")):
        save_file(archive, f"pools/{figures.name}", figures)
        saved.append(f"pools/{figures.name}")
    return saved
