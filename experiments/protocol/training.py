"""One run of the protocol: the shared warm-up every run starts from, and one RL run on the shared services
(to its plateau for a baseline), each reused when it finished before, here or in the archive."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from rlep.experiments.protocol import archive as archived
from rlep.experiments.protocol.compare import plateau_step
from rlep.experiments.protocol.config import ProtocolConfig
from rlep.experiments.protocol.pool import machine
from rlep.services.learner.config import TrainConfig

# Per-step figures of replay's signal each run keeps (StepRecord fields; services/learner/replay_signal.py).
REPLAY_FIGURES = ("replay_advantage_share", "replay_signal_groups", "replay_logprob_mean", "replay_sequence_prob_mean")


def shared_warmup(cfg: ProtocolConfig, build: bool = True) -> tuple[Path, float | None]:
    """The one warm-up checkpoint of the protocol, under ~/.cache/rlep/warmup/<key of its settings>/ (built when
    missing, if `build`), and its pass@1."""
    from rlep.common.tiny_model import cached_model
    from rlep.services.demo.warmup import RESULT_FILE, WarmupConfig, warmup

    config = WarmupConfig(terms=cfg.terms, max_value=cfg.max_value, max_new_tokens=cfg.max_response_tokens)
    base = cached_model("tiny")
    key = json.dumps([base.name, cfg.warmup_steps, cfg.warmup_seed, config.model_dump(mode="json")], sort_keys=True)
    out = Path.home() / ".cache" / "rlep" / "warmup" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if cfg.archive and not (out / RESULT_FILE).exists():
        archived.restore_checkpoint(cfg.archive, "warmup", out)  # every pair of runs must share one warm-up
    if not (out / RESULT_FILE).exists():
        if not build:
            return out, None
        warmup(base, out, cfg.warmup_steps, seed=cfg.warmup_seed, config=config)
        if cfg.archive:
            archived.save_checkpoint(cfg.archive, "warmup", out)
    return out, json.loads((out / RESULT_FILE).read_text())["pass_at_1"]


def train_run(config: TrainConfig, stack, stop_at_plateau: ProtocolConfig | None, archive: Path | None = None) -> dict:
    """One RL run on the shared services; with `stop_at_plateau` it ends at the plateau rule's step. A run
    finished before (here, or in `archive`) is not run again.

    Returns the run's curve, where it stopped and why, and its per-step costs (result.json).
    """
    from rlep.services.launch.training import run_training
    from rlep.services.learner.records import StepRecord

    done = config.checkpoint.dir / "result.json"
    if archive and archived.restore_file(archive, f"results/{config.run_id}.json", done):
        return json.loads(done.read_text())
    if done.exists():
        return json.loads(done.read_text())
    if config.log_file.exists():
        config.log_file.unlink()  # an interrupted run starts over
    records: list = []
    started = time.perf_counter()

    def curve() -> list[tuple[int, float]]:
        return [(r.step, r.eval_accuracy) for r in records if r.eval_accuracy is not None]

    def plateau() -> int | None:
        return plateau_step(curve(), stop_at_plateau.patience, stop_at_plateau.min_delta)

    stop_when = (lambda: plateau() is not None) if stop_at_plateau else None
    run_training(config, stack=stack, on_step=records.append, stop_when=stop_when)
    steps = [r for r in records if isinstance(r, StepRecord)]
    result = {
        "run_id": config.run_id,
        "seed": config.seed,
        "curve": curve(),
        # Correct samples per held-out question at each evaluation (issue 49: accuracy sliced by difficulty).
        "curve_correct": [(r.step, r.eval_correct) for r in records if r.eval_correct is not None],
        "steps": len(steps),
        "plateau_step": plateau() if stop_at_plateau else None,
        "step_seconds": [r.step_seconds for r in steps],
        "sequences": [r.sequences for r in steps],
        "response_tokens": [r.response_length_mean * r.sequences for r in steps],
        "replayed_fraction": [r.replayed_fraction for r in steps],
        "fresh_accuracy": [r.fresh_accuracy for r in steps],
        # Why replay helps or not (replay_signal.py); None on steps without replayed rows.
        **{name: [getattr(r, name) for r in steps] for name in REPLAY_FIGURES},
        "optimizer_steps": steps[-1].optimizer_steps if steps else None,
        "wall_seconds": time.perf_counter() - started,
        "machine": machine(),
    }
    done.write_text(json.dumps(result))
    if archive:
        archived.save_file(archive, f"results/{config.run_id}.json", done)
    return result
