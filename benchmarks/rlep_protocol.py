"""RLEP vs the M=0 baseline, the paper's protocol in miniature with paired seeds (issue 15). Defaults ARE the protocol.

1. One supervised warm-up of the tiny model (fixed seed), cached on disk under a key of its settings and
   shared by every run.
2. Baseline (M=0) per RL seed until it has converged: no new best by more than `min_delta` (one standard error
   of an evaluation) over `patience` evaluations in a row, capped at `max_steps` (a capped run is reported as
   such). Each step takes `questions_per_step / mini_batch_questions` PPO mini-batch updates, as the paper does
   (512 / 64 = 8 there).
3. Collection from the first seed's converged (final) baseline policy: N samples at T=0.7, top-p 0.95;
   questions with >= 2 correct samples go to the pool. Reports the pool's coverage and diversity.
4. RLEP (M replayed successes per question) from the same warm-up model, one run per RL seed, as many
   steps as that seed's baseline ran; and, with `equal_updates_arm`, RLEP with mini-batches sized over all
   G + M rows (`algorithm.mini_batch_rows: all`): as many optimizer updates per step as the baseline, so
   replay's effect is not its extra updates.
5. Held-out set of `eval_questions` x `eval_samples` (one sample per question: SE = sqrt(p(1-p)/Q) <= 0.01
   at any p for Q >= 2,500), evaluated every `eval_every` steps with the run's seed as sampling seed, so
   both arms of a seed are scored with the same evaluation seed.
6. Per-seed figures and paired differences (RLEP - baseline) with bootstrap 95% intervals; one PNG, the
   JSON and rich tables (benchmarks/rlep_protocol_report.py). `--ablations` adds the ablation cells.

    python benchmarks/rlep_protocol.py                       # the protocol (~2 h on 2 cores)
    python benchmarks/rlep_protocol.py --ablations           # + the ablation table (see ABLATIONS)
    python benchmarks/rlep_protocol.py --set seeds=[0,1] --set max_steps=4 ...   # a smoke run

Finished runs are kept under `work_dir/<run>/result.json` and reused on a rerun (delete to redo them), and in
`archive` (committed: benchmarks/protocol_archive.py) with the checkpoints the rest starts from, so a rerun on
another machine resumes where the last one stopped; `--archive` saves what has finished (a run in progress
started before this code existed saves nothing itself).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import protocol_archive as archived  # noqa: E402
from protocol_pool import collect_pool, copy_pool, machine  # noqa: E402

from rlep.common.config import StrictModel, deep_merge, load_config  # noqa: E402
from rlep.services.eval.compare import plateau_step  # noqa: E402
from rlep.services.learner.config import TrainConfig  # noqa: E402

# Every ablation cell: RLEP with these TrainConfig.algorithm values (and a pool) for `ablation_seeds` seeds.
# `pool`: "phase1" (the protocol's), "phase1-distinct" (collected with >= 2 distinct), "phase1-half" (collected
# from the first baseline's checkpoint at half its steps), "copy" (a per-run
# copy of phase1, since online replay writes to it), "empty" (a per-run empty pool).
# In the order they run: the ones that decide a user's defaults (M, online replay) first.
ABLATIONS: dict[str, dict[str, Any]] = {
    "M=1": {"algorithm": {"replayed_per_question": 1}},
    "M=4": {"algorithm": {"replayed_per_question": 4}},
    "online replay + phase-1 pool": {"algorithm": {"online_replay": True}, "pool": "copy"},
    "online replay, no phase-1 pool": {"algorithm": {"online_replay": True}, "pool": "empty"},
    "strategy=diverse": {"algorithm": {"replay_strategy": "diverse"}},
    "strategy=recency": {"algorithm": {"replay_strategy": "recency"}},
    "strategy=prioritized": {"algorithm": {"replay_strategy": "prioritized"}},
    "collect rule >= 2 distinct": {"pool": "phase1-distinct"},
    "pool from the half-trained policy": {"pool": "phase1-half"},
}
# The cells issue 29 asks for (>= 3 seeds each): how many replayed rows, how strong the pool's policy, which draw.
ISSUE_CELLS = ["M=1", "M=4", "pool from the half-trained policy", "strategy=diverse"]
NOT_RUNNABLE = {
    "replay failures too": "the replay service keeps CORRECT trajectories only (services/replay/server.py rejects "
    "others), collect() stores successes only, and the learner re-verifies replayed rows expecting successes",
}


# Per-step figures of replay's signal each run keeps (StepRecord fields; services/learner/replay_signal.py).
REPLAY_FIGURES = ("replay_advantage_share", "replay_signal_groups", "replay_logprob_mean", "replay_sequence_prob_mean")


class ProtocolConfig(StrictModel):
    """Sizes and rules of the protocol; `--set key=value` overrides one (e.g. `--set seeds=[0,1]`)."""

    seeds: list[int] = Field([0, 1, 2, 3, 4], min_length=1)
    """RL seeds; both arms run each. The first one's baseline is collected from."""
    work_dir: Path = Path("runs/rlep-protocol")
    """Checkpoints, step logs and per-run results (reused on a rerun)."""
    results: Path = Path("benchmarks/results/rlep_protocol_issue29")
    """Prefix of the JSON and PNG written (`.json`, `.png`). The defaults are issue 29's protocol, so its report is
    the default: `rlep_protocol.*` holds issue 15's figures, which a run of today's defaults must not overwrite."""
    archive: Path | None = Path("benchmarks/results/rlep_protocol_archive")
    """Finished runs and the checkpoints the rest starts from, kept in the repository (None: not kept)."""
    terms: int = Field(3, ge=2)
    """Numbers per problem. Issue 29's task (benchmarks/task_pilots.py): sums of 3 numbers in [1, 50], 3 valid
    solution paths per question; its warm-up starts near 0.21 and plain RL converges near 0.53 (the pilot of the
    issue-15 task, 4 numbers in [1, 16], started at 0.37 and converged near 0.52)."""
    max_value: int = Field(50, ge=2)
    """Numbers in [1, max_value]: 50^3 = 125,000 problems, room for 2,500 held-out eval questions."""
    warmup_steps: int = Field(600, ge=0)
    warmup_seed: int = 0
    train_questions: int = Field(256, ge=8)
    """Training problems: small enough that each is seen several times and the pool covers most of them."""
    eval_questions: int = Field(2500, ge=8)
    eval_samples: int = Field(1, ge=1)
    eval_every: int = Field(20, ge=1)
    """An evaluation (2,500 generations) costs about as much as 10 training steps on 2 cores: every 20 steps keeps
    five seeds of both arms within ~2 h (every 10 would take ~3 h)."""
    questions_per_step: int = Field(16, ge=1)
    mini_batch_questions: int = Field(4, ge=1)
    """PPO mini-batch: questions_per_step / this = optimizer updates per step (4 here, 8 in the paper)."""
    fresh_per_question: int = Field(8, ge=2)
    replayed_per_question: int = Field(2, ge=1)
    lr: float = Field(3e-5, gt=0)
    """With 4 mini-batch updates per step, 1e-4 (the demo's, 1 update) made the baseline fall 0.40 -> 0.34 in 10 steps
    and stay there to step 40; 3e-5 dipped to 0.37 and rose to 0.425 by step 40 (seed 0, 400 eval questions)."""
    max_response_tokens: int = Field(48, ge=8)
    max_steps: int = Field(600, ge=1)
    """Cap of the baseline, far beyond where baselines converged before (60-200 steps); a capped run is reported as
    not converged."""
    patience: int = Field(5, ge=1)
    """Evaluations without a new best that count as converged (5 x 20 = 100 steps without one)."""
    min_delta: float = Field(0.01, ge=0)
    """A new best must beat the old by more than this (one standard error of an evaluation)."""
    equal_updates_arm: bool = True
    """Also run RLEP with as many optimizer updates per step as the baseline (mini-batches over G + M rows)."""
    collect_samples: int = Field(64, ge=2)
    collect_rule: Literal["correct", "distinct"] = "correct"
    """Keep questions with >= 2 correct samples (the paper) or >= 2 distinct correct texts."""
    ablation_seeds: int = Field(3, ge=1)
    """Seeds per ablation cell (the first ones of `seeds`); a cell of one seed is no finding."""
    ablation_cells: list[str] | None = ISSUE_CELLS
    """The cells to run (names of ABLATIONS); None = all. Cells left out are reported as not run."""
    train: dict[str, Any] = {}
    """TrainConfig values every run shares beyond the above (default: configs/demo.yaml's `train`)."""

    @model_validator(mode="after")
    def _evaluated_at_cap(self) -> ProtocolConfig:
        if unknown := set(self.ablation_cells or []) - set(ABLATIONS):
            raise ValueError(f"unknown ablation cells {sorted(unknown)}; choose from {sorted(ABLATIONS)}")
        if self.max_steps % self.eval_every:
            raise ValueError("max_steps must be a multiple of eval_every (a run stops at an evaluation)")
        if self.questions_per_step % self.mini_batch_questions:
            raise ValueError("questions_per_step must be a multiple of mini_batch_questions")
        return self


def demo_train_settings() -> dict[str, Any]:
    from rlep.services.demo.runner import load_demo_config

    return load_demo_config().train.model_dump(exclude_unset=True)


def run_config(
    cfg: ProtocolConfig, run_id: str, seed: int, steps: int, model: Path, pool: str, extra: dict
) -> TrainConfig:
    """The TrainConfig of one run: the protocol's sizes over the shared settings, then `extra` (an ablation).
    The first seed's baseline keeps a checkpoint at every evaluation: the half-trained pool comes from one."""
    work = cfg.work_dir / run_id
    keep_all = run_id == f"baseline-s{cfg.seeds[0]}"
    checkpoint = {"every_steps": cfg.eval_every, "keep_last": cfg.max_steps // cfg.eval_every} if keep_all else {}
    run = {
        "run_id": run_id,
        "model": str(model),
        "seed": seed,
        "steps": steps,
        "replay_pool": pool,
        "algorithm": {
            "questions_per_step": cfg.questions_per_step,
            "fresh_per_question": cfg.fresh_per_question,
            "replayed_per_question": 0 if run_id.startswith("baseline") else cfg.replayed_per_question,
            "max_response_tokens": cfg.max_response_tokens,
            "mini_batch_questions": cfg.mini_batch_questions,
        },
        "optim": {"lr": cfg.lr},
        "checkpoint": {"dir": str(work), "every_steps": steps, "keep_last": 1, **checkpoint},
        "log_file": str(work / "log.jsonl"),
        "data": {"train_files": [str(cfg.work_dir / "train.parquet")]},
        "eval": {
            "every_steps": cfg.eval_every,
            "files": [str(cfg.work_dir / "eval.parquet")],
            "samples_per_question": cfg.eval_samples,
            "max_questions": cfg.eval_questions,
        },
    }
    settings = deep_merge(deep_merge(cfg.train or demo_train_settings(), run), extra)
    return TrainConfig.model_validate(settings)


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
    from rlep.services.cli.run import run_training
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


def run_protocol(cfg: ProtocolConfig, ablations: bool) -> dict:
    from rlep.common.ray_local import init_ray
    from rlep.services.cli.stack import ServiceStack
    from rlep.services.demo.task import make_problems, write_parquet

    started = time.perf_counter()
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    write_parquet(
        make_problems(cfg.train_questions, 0, "train", cfg.terms, cfg.max_value), cfg.work_dir / "train.parquet"
    )
    write_parquet(make_problems(cfg.eval_questions, 0, "eval", cfg.terms, cfg.max_value), cfg.work_dir / "eval.parquet")
    warm, warm_pass = shared_warmup(cfg)
    init_ray()

    def config(run_id: str, seed: int, steps: int, pool: str = "protocol-phase1", extra: dict | None = None):
        return run_config(cfg, run_id, seed, steps, warm, pool, extra or {})

    stack = ServiceStack(config("baseline-s0", 0, cfg.max_steps), warm, app_name="rlep-protocol-rollout")
    stack.start(need_replay=True)
    out: dict[str, Any] = {"warmup": {"dir": str(warm), "pass_at_1": warm_pass}, "baseline": {}, "rlep": {}}
    if cfg.equal_updates_arm:
        out["rlep_equal"] = {}
    try:
        # The first seed's baseline and the pool, then both arms seed by seed: whatever time allows ends in
        # complete pairs (a rerun reuses finished runs).
        first = cfg.seeds[0]
        out["baseline"][first] = train_run(config(f"baseline-s{first}", first, cfg.max_steps), stack, cfg, cfg.archive)
        checkpoint = checkpoint_of_first_baseline(cfg, out["baseline"][first]["steps"])
        base = config("collect", first, 1)
        out["pool"] = collect_pool(cfg, stack, checkpoint, "protocol-phase1", cfg.collect_rule, base)
        for seed in cfg.seeds:
            if seed != first:
                out["baseline"][seed] = train_run(
                    config(f"baseline-s{seed}", seed, cfg.max_steps), stack, cfg, cfg.archive
                )
            steps = out["baseline"][seed]["steps"]
            out["rlep"][seed] = train_run(config(f"rlep-s{seed}", seed, steps), stack, None, cfg.archive)
            if cfg.equal_updates_arm:
                equal = config(f"rlep-equal-s{seed}", seed, steps, extra={"algorithm": {"mini_batch_rows": "all"}})
                out["rlep_equal"][seed] = train_run(equal, stack, None, cfg.archive)
        if ablations:
            out["ablations"] = run_ablations(cfg, stack, config, out, checkpoint, base)
    finally:
        stack.close()
    out["wall_seconds"] = time.perf_counter() - started
    return out


def run_ablations(cfg: ProtocolConfig, stack, config, out: dict, checkpoint: Path, base: TrainConfig) -> dict:
    """Each cell: RLEP variant runs for the first `ablation_seeds` seeds, as long as their baselines."""
    replay = stack.services.replay
    cells: dict[str, dict] = {name: {"not_run": why} for name, why in NOT_RUNNABLE.items()}
    other_rule = "distinct" if cfg.collect_rule == "correct" else "correct"
    for name, spec in ABLATIONS.items():
        if cfg.ablation_cells is not None and name not in cfg.ablation_cells:
            cells[name] = {"not_run": "left out of this run's budget (ablation_cells)"}
            continue
        runs = {}
        for seed in cfg.seeds[: cfg.ablation_seeds]:
            run_id = ablation_run_id(name, seed)
            pool = "protocol-phase1"
            if spec.get("pool") == "phase1-distinct":
                pool = f"protocol-phase1-{other_rule}"
                out.setdefault("pool_other_rule", collect_pool(cfg, stack, checkpoint, pool, other_rule, base))
            elif spec.get("pool") == "phase1-half":
                pool, half = "protocol-phase1-half", half_checkpoint(cfg, out["baseline"][cfg.seeds[0]]["steps"])
                out.setdefault("pool_half", collect_pool(cfg, stack, half, pool, cfg.collect_rule, base))
            elif spec.get("pool") in ("copy", "empty"):
                pool = f"protocol-{run_id}"
                if not (cfg.work_dir / run_id / "result.json").exists():  # a fresh pool per run
                    if pool in replay.list_pools():
                        replay.drop(pool, confirm=pool)
                    if spec["pool"] == "copy":
                        copy_pool(replay, "protocol-phase1", pool)
            extra = {k: v for k, v in spec.items() if k != "pool"}
            run = config(run_id, seed, out["baseline"][seed]["steps"], pool, extra)
            runs[seed] = train_run(run, stack, None, cfg.archive)
        cells[name] = {"runs": runs}
    return cells


def half_step(cfg: ProtocolConfig, steps: int) -> int:
    """Where the first baseline's half-way checkpoint is: half its steps, rounded down to an evaluation."""
    return max(cfg.eval_every, steps // 2 // cfg.eval_every * cfg.eval_every)


def checkpoint_of_first_baseline(cfg: ProtocolConfig, step: int) -> Path:
    """The first baseline's HF checkpoint at `step` (a pool is collected from it), from the archive when missing
    here (a rerun on another machine); saved to the archive when it is not there yet."""
    name = f"baseline-s{cfg.seeds[0]}"
    hf = cfg.work_dir / name / f"step_{step}" / "hf"
    if cfg.archive:
        if not archived.restore_checkpoint(cfg.archive, f"{name}-step_{step}", hf):
            raise SystemExit(f"{hf} is missing, and {cfg.archive} has no copy: delete {name}'s result to rerun it")
        archived.save_checkpoint(cfg.archive, f"{name}-step_{step}", hf)
    return hf


def half_checkpoint(cfg: ProtocolConfig, steps: int) -> Path:
    """The first baseline's checkpoint at half its steps (rounded down to an evaluation, at least the first)."""
    return checkpoint_of_first_baseline(cfg, half_step(cfg, steps))


def ablation_run_id(cell: str, seed: int) -> str:
    return "abl-" + "".join(c if c.isalnum() else "-" for c in cell) + f"-s{seed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None, help="YAML over the defaults")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="ProtocolConfig override, key=value")
    parser.add_argument("--ablations", action="store_true", help="also run the ablation cells")
    parser.add_argument("--report-only", action="store_true", help="report what has finished (cells: --ablations)")
    parser.add_argument("--archive", action="store_true", help="archive what has finished, then exit")
    args = parser.parse_args()
    cfg = load_config(ProtocolConfig, args.config, sets=args.sets, env_prefix="protocol")
    if args.archive:
        warm, _ = shared_warmup(cfg, build=False)
        first = f"baseline-s{cfg.seeds[0]}"
        saved = archived.archive_finished(cfg.archive, cfg.work_dir, warm, first, lambda n: half_step(cfg, n))
        print("\n".join(f"archived {name}" for name in saved) or "nothing has finished")
        return

    from rlep_protocol_report import report

    if args.report_only:
        from protocol_finished import finished_runs

        cfg, raw = finished_runs(cfg, args.ablations)
    else:
        raw = run_protocol(cfg, args.ablations)
    report(cfg, raw)


if __name__ == "__main__":
    main()
