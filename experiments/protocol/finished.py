"""What `run --report-only` reports: the runs already finished (here or in the archive), read back as
`run_protocol` returns them, without starting anything."""

from __future__ import annotations

import json
from typing import Any

from rlep.experiments.protocol import archive as archived
from rlep.experiments.protocol.config import ABLATIONS, NOT_RUNNABLE, ProtocolConfig, ablation_run_id
from rlep.experiments.protocol.training import shared_warmup


def finished_runs(cfg: ProtocolConfig, ablations: bool) -> tuple[ProtocolConfig, dict]:
    """The results of the runs already done, as run_protocol returns them, without starting anything: what
    `--report-only` reports. Returns `cfg` narrowed to the seeds whose arms have all finished; with
    `ablations`, the cells with at least one finished run among those seeds."""

    def result(run_id: str) -> dict | None:
        path = cfg.work_dir / run_id / "result.json"
        if cfg.archive:
            archived.restore_file(cfg.archive, f"results/{run_id}.json", path)
        return json.loads(path.read_text()) if path.exists() else None

    if cfg.archive:
        for figures in (cfg.archive / "pools").glob("pool-*.json"):
            archived.restore_file(cfg.archive, f"pools/{figures.name}", cfg.work_dir / figures.name)

    names = {"baseline": "baseline", "rlep": "rlep", **({"rlep_equal": "rlep-equal"} if cfg.equal_updates_arm else {})}
    arms = {arm: {s: result(f"{name}-s{s}") for s in cfg.seeds} for arm, name in names.items()}
    seeds = [s for s in cfg.seeds if all(runs[s] for runs in arms.values())]
    if not seeds:
        raise SystemExit(f"no seed has both arms finished under {cfg.work_dir}")
    cfg = cfg.model_copy(update={"seeds": seeds})
    warm, warm_pass = shared_warmup(cfg, build=False)
    out: dict[str, Any] = {
        "warmup": {"dir": str(warm), "pass_at_1": warm_pass},
        **{arm: {s: runs[s] for s in seeds} for arm, runs in arms.items()},
        "pool": json.loads((cfg.work_dir / "pool-protocol-phase1.json").read_text()),
    }
    runs = [run for arm in arms for run in out[arm].values()]
    pools = [out["pool"]]
    if (half := cfg.work_dir / "pool-protocol-phase1-half.json").exists():
        out["pool_half"] = json.loads(half.read_text())
        pools.append(out["pool_half"])
    if ablations:
        out["ablations"] = {name: {"not_run": why} for name, why in NOT_RUNNABLE.items()}
        for name in ABLATIONS:
            done = {s: r for s in seeds[: cfg.ablation_seeds] if (r := result(ablation_run_id(name, s)))}
            left_out = cfg.ablation_cells is not None and name not in cfg.ablation_cells
            why = "left out of this run's budget (ablation_cells)" if left_out else "not finished when reported"
            out["ablations"][name] = {"runs": done} if done else {"not_run": why}
            runs += done.values()
        other = cfg.work_dir / f"pool-protocol-phase1-{'distinct' if cfg.collect_rule == 'correct' else 'correct'}.json"
        if other.exists():
            out["pool_other_rule"] = json.loads(other.read_text())
            pools.append(out["pool_other_rule"])
    # Runs finished before runs recorded their wall time have none: the total is then unknown.
    walls = [r.get("wall_seconds") for r in runs] + [p.get("seconds") for p in pools]
    out["wall_seconds"] = sum(walls) if None not in walls else None
    return cfg, out
