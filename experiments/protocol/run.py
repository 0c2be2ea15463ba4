"""RLEP vs the M=0 baseline, the paper's protocol in miniature with paired seeds (issue 15). Defaults ARE the protocol.

1. One supervised warm-up of the tiny model (fixed seed), cached on disk under a key of its settings and
   shared by every run.
2. Baseline (M=0) per RL seed for `max_steps` steps, a horizon fixed before the runs (issue 49; `horizon:
   plateau` stops it instead once it has converged: no new best by more than `min_delta` over `patience`
   evaluations in a row, issues 15 and 29). Each step takes `questions_per_step / mini_batch_questions` PPO
   mini-batch updates, as the paper does (512 / 64 = 8 there).
3. Collection from the first seed's converged (final) baseline policy: N samples at T=0.7, top-p 0.95;
   questions with >= 2 correct samples go to the pool. Reports the pool's coverage and diversity.
4. RLEP (M replayed successes per question) from the same warm-up model, one run per RL seed, as many
   steps as that seed's baseline ran, on the CPU model that baseline ran on (another is refused unless
   `pair_on_other_cpu`); and, with `equal_updates_arm`, RLEP with mini-batches sized over all
   G + M rows (`algorithm.mini_batch_rows: all`): as many optimizer updates per step as the baseline, so
   replay's effect is not its extra updates.
5. Held-out set of `eval_questions` x `eval_samples` (one sample per question: SE = sqrt(p(1-p)/Q) <= 0.01
   at any p for Q >= 2,500), evaluated every `eval_every` steps with the run's seed as sampling seed, so
   both arms of a seed are scored with the same evaluation seed.
6. Issue 49's named endpoints (`endpoints`: early gain, plateau on one fixed horizon) and its pre-registered
   decision (`decision`) first, then per-seed figures and paired differences (RLEP - baseline) with Student t 95%
   intervals (df = n - 1) and the percentile bootstrap beside them (`intervals`); one PNG, the JSON and rich tables
   (`report`). `--ablations` adds the ablation cells (exploratory, Holm-corrected across cells).

    python -m rlep.experiments.protocol.run                  # the protocol (~2 h on 2 cores)
    python -m rlep.experiments.protocol.run --ablations      # + the ablation table (see ABLATIONS)
    python -m rlep.experiments.protocol.run --set seeds=[0,1] --set max_steps=4 ...   # a smoke run
    python -m rlep.experiments.protocol.run --report-only --ablations   # report the archive, start nothing
    python -m rlep.experiments.protocol.run --endpoints-of experiments/protocol/results/issue15.json

Finished runs are kept under `work_dir/<run>/result.json` and reused on a rerun (delete to redo them), and in
the committed archive (`archive`) with the checkpoints the rest starts from, so a rerun on
another machine resumes where the last one stopped; `--archive` saves what has finished (a run in progress
started before this code existed saves nothing itself).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rlep.common.config import load_config
from rlep.experiments.protocol import archive as archived
from rlep.experiments.protocol.config import (
    ABLATIONS,
    NOT_RUNNABLE,
    ProtocolConfig,
    ablation_run_id,
    half_step,
    run_config,
)
from rlep.experiments.protocol.finished import finished_runs
from rlep.experiments.protocol.pool import collect_pool, copy_pool
from rlep.experiments.protocol.report import report
from rlep.experiments.protocol.training import shared_warmup, train_run
from rlep.services.learner.config import TrainConfig


def run_protocol(cfg: ProtocolConfig, ablations: bool) -> dict:
    from rlep.common.ray_local import init_ray
    from rlep.services.demo.task import make_problems, write_parquet
    from rlep.services.launch.stack import ServiceStack

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

    stop = cfg if cfg.horizon == "plateau" else None  # a baseline's stopping rule

    def arm(run: TrainConfig, seed: int) -> dict:
        baseline = out["baseline"][seed]
        return train_run(run, stack, None, cfg.archive, pair_with=baseline, pair_on_other_cpu=cfg.pair_on_other_cpu)

    stack = ServiceStack(config("baseline-s0", 0, cfg.max_steps), warm, app_name="rlep-protocol-rollout")
    stack.start(need_replay=True)
    out: dict[str, Any] = {"warmup": {"dir": str(warm), "pass_at_1": warm_pass}, "baseline": {}, "rlep": {}}
    if cfg.equal_updates_arm:
        out["rlep_equal"] = {}
    try:
        # The first seed's baseline and the pool, then both arms seed by seed: whatever time allows ends in
        # complete pairs (a rerun reuses finished runs).
        first = cfg.seeds[0]
        out["baseline"][first] = train_run(config(f"baseline-s{first}", first, cfg.max_steps), stack, stop, cfg.archive)
        checkpoint = checkpoint_of_first_baseline(cfg, out["baseline"][first]["steps"])
        base = config("collect", first, 1)
        out["pool"] = collect_pool(cfg, stack, checkpoint, "protocol-phase1", cfg.collect_rule, base)
        for seed in cfg.seeds:
            if seed != first:
                out["baseline"][seed] = train_run(
                    config(f"baseline-s{seed}", seed, cfg.max_steps), stack, stop, cfg.archive
                )
            steps = out["baseline"][seed]["steps"]
            out["rlep"][seed] = arm(config(f"rlep-s{seed}", seed, steps), seed)
            if cfg.equal_updates_arm:
                equal = config(f"rlep-equal-s{seed}", seed, steps, extra={"algorithm": {"mini_batch_rows": "all"}})
                out["rlep_equal"][seed] = arm(equal, seed)
        if ablations:
            out["ablations"] = run_ablations(cfg, stack, config, arm, out, checkpoint, base)
    finally:
        stack.close()
    out["wall_seconds"] = time.perf_counter() - started
    return out


def run_ablations(cfg: ProtocolConfig, stack, config, arm, out: dict, checkpoint: Path, base: TrainConfig) -> dict:
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
            elif spec.get("pool") in ("copy", "fresh-copy", "empty"):
                pool = f"protocol-{run_id}"
                if not (cfg.work_dir / run_id / "result.json").exists():  # a fresh pool per run
                    if pool in replay.list_pools():
                        replay.drop(pool, confirm=pool)
                    if spec["pool"] != "empty":
                        copy_pool(replay, "protocol-phase1", pool, histories=spec["pool"] == "copy")
            extra = {k: v for k, v in spec.items() if k != "pool"}
            run = config(run_id, seed, out["baseline"][seed]["steps"], pool, extra)
            runs[seed] = arm(run, seed)
        cells[name] = {"runs": runs}
    return cells


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None, help="YAML over the defaults")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="ProtocolConfig override, key=value")
    parser.add_argument("--ablations", action="store_true", help="also run the ablation cells")
    parser.add_argument("--report-only", action="store_true", help="report what has finished (cells: --ablations)")
    parser.add_argument("--archive", action="store_true", help="archive what has finished, then exit")
    parser.add_argument(
        "--endpoints-of", type=Path, default=None, help="report a summary JSON's runs with today's statistics"
    )
    args = parser.parse_args()
    if args.endpoints_of:
        from rich.console import Console

        from rlep.experiments.protocol.summary_report import report_summary

        report_summary(args.endpoints_of, Console(width=200))
        return
    cfg = load_config(ProtocolConfig, args.config, sets=args.sets, env_prefix="protocol")
    if args.archive:
        warm, _ = shared_warmup(cfg, build=False)
        first = f"baseline-s{cfg.seeds[0]}"
        saved = archived.archive_finished(cfg.archive, cfg.work_dir, warm, first, lambda n: half_step(cfg, n))
        print("\n".join(f"archived {name}" for name in saved) or "nothing has finished")
        return

    if args.report_only:
        cfg, raw = finished_runs(cfg, args.ablations)
    else:
        raw = run_protocol(cfg, args.ablations)
    report(cfg, raw)


if __name__ == "__main__":
    main()
