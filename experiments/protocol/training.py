"""One run of the protocol: the shared warm-up every run starts from, and one RL run on the shared services
(to the horizon, or to its plateau for a baseline under `horizon: plateau`), each reused when it finished before,
here or in the archive, and refused when it cannot pair with its seed's baseline."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from rlep.experiments.protocol import archive as archived
from rlep.experiments.protocol.compare import plateau_step
from rlep.experiments.protocol.config import ProtocolConfig
from rlep.experiments.protocol.endpoints import DIFFERENT, cpu_model, pairing
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


def reuse_problem(result: dict, steps: int, stops_at_plateau: bool) -> str | None:
    """Why a finished run's result cannot stand for a run of `steps` steps (None when it can): a run that trained
    another number of steps than asked, unless the plateau rule may have stopped it earlier."""
    if result["steps"] == steps or (stops_at_plateau and result["steps"] < steps):
        return None
    why = f"stopped at its plateau (step {result['plateau_step']})" if result.get("plateau_step") else "ran"
    return (
        f"{result['run_id']} {why} {result['steps']} steps, this run asks {steps}: give a run of another horizon its "
        "own folders (--set work_dir=... --set archive=... --set results=...), or --set horizon=plateau to go on "
        "with issue 29's runs"
    )


def pairing_problem(baseline: dict, here: str, allowed: bool) -> str | None:
    """Why an arm must not start on this machine (`here`: `pool.machine()`) beside its seed's `baseline` result
    (None when it may): another CPU model or core count, unless `allowed` (`pair_on_other_cpu`)."""
    if allowed or pairing(baseline, {"machine": here}) != DIFFERENT:
        return None
    return (
        f"{baseline['run_id']} ran on {cpu_model(baseline['machine'])}, this machine is {cpu_model(here)}: its arms "
        "must run on the same CPU to pair (issue 49). Run them there, or --set pair_on_other_cpu=true to train "
        "them here and report the pair unpaired"
    )


def train_run(
    config: TrainConfig,
    stack,
    stop_at_plateau: ProtocolConfig | None,
    archive: Path | None = None,
    pair_with: dict | None = None,
    pair_on_other_cpu: bool = False,
) -> dict:
    """One RL run on the shared services of `config.steps` steps; with `stop_at_plateau` it ends at the plateau
    rule's step. A run finished before (here, or in `archive`) is not run again, unless it trained another number of
    steps (SystemExit). An arm (`pair_with`: its seed's baseline result) that would train on another CPU model than
    that baseline is refused (SystemExit) unless `pair_on_other_cpu`.

    Returns the run's curve, where it stopped and why, and its per-step costs (result.json).
    """
    from rlep.services.launch.training import run_training
    from rlep.services.learner.records import StepRecord

    done = config.checkpoint.dir / "result.json"
    restored = archive and archived.restore_file(archive, f"results/{config.run_id}.json", done)
    if restored or done.exists():
        result = json.loads(done.read_text())
        if problem := reuse_problem(result, config.steps, stop_at_plateau is not None):
            raise SystemExit(problem)
        return result
    if pair_with is not None and (problem := pairing_problem(pair_with, machine(), pair_on_other_cpu)):
        raise SystemExit(problem)
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
        # Why it ended: its plateau, the cap of the plateau rule, or the fixed horizon (issue 49).
        "stopped_by": ("plateau" if plateau() is not None else "cap") if stop_at_plateau else "horizon",
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
