"""Report of the protocol (`run`) from its runs' results: costs, replay signal, tables, PNG and JSON (the
per-seed and paired figures: `figures`; statistics: `compare`)."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from rlep.common.curves import peak
from rlep.experiments.protocol.decision import decide
from rlep.experiments.protocol.endpoint_tables import print_ablation_endpoints, print_endpoints
from rlep.experiments.protocol.endpoints import ablation_endpoints, arm_endpoints
from rlep.experiments.protocol.figures import MEDIAN_RATIO, paired, run_figures


def eval_standard_error(cfg, accuracy: float) -> float:
    """SE of one evaluation at `accuracy`: exact for one sample per question, an upper bound for more
    (samples of one question are correlated, at worst fully: then the question count alone counts)."""
    return math.sqrt(accuracy * (1 - accuracy) / cfg.eval_questions)


def seconds_to(run: dict, step: int | None) -> float | None:
    """Training seconds of `run` up to `step` (its step times summed; evaluations excluded), None if not reached."""
    return None if step is None else sum(run["step_seconds"][:step])


def costs(cfg, raw: dict, arm: str, per_seed: dict) -> dict:
    """What the arm cost against the baseline, phase 1 included: the pool's price in baseline steps, training time to
    the baseline's peak per seed, and how many runs reusing the pool pay for it (its price / the time saved per run)."""
    first = raw["baseline"][cfg.seeds[0]]
    base_step_s = statistics.mean(first["step_seconds"])
    pool_s = sum(first["step_seconds"]) + raw["pool"]["seconds"]
    saved = []
    for seed, f in per_seed.items():
        to_peak = seconds_to(raw["baseline"][seed], f["baseline_peak_step"])
        arm_to_peak = seconds_to(raw[arm][seed], f["rlep_steps_to_baseline_peak"])
        if arm_to_peak is not None:
            saved.append(to_peak - arm_to_peak)
    mean_saved = statistics.mean(saved) if saved else None
    runs = (("baseline", "baseline"), ("arm", arm))
    return {
        "pool_seconds": pool_s,
        "pool_in_baseline_steps": pool_s / base_step_s,
        "phase1_steps": first["steps"],
        "collection_seconds": raw["pool"]["seconds"],
        "step_seconds": {
            name: statistics.mean(x for s in cfg.seeds for x in raw[a][s]["step_seconds"]) for name, a in runs
        },
        "run_seconds": {name: statistics.mean(sum(raw[a][s]["step_seconds"]) for s in cfg.seeds) for name, a in runs},
        "seconds_saved_to_baseline_peak": mean_saved,
        "seeds_reaching_baseline_peak": len(saved),
        "seeds": len(per_seed),
        # A single RLEP run never repays phase 1 (a whole baseline run); later runs on the same pool may.
        "runs_to_break_even": None if not mean_saved or mean_saved <= 0 else math.ceil(pool_s / mean_saved),
    }


ARMS = {"rlep": "RLEP (M=2, verl's mini-batches)", "rlep_equal": "RLEP, as many updates as the baseline"}


def report(cfg, raw: dict) -> dict:
    seeds = cfg.seeds
    per_seed = {s: run_figures(raw["baseline"][s], raw["rlep"][s]) for s in seeds}
    arms = {}
    for arm, label in ARMS.items():
        if arm in raw:
            figures = {s: run_figures(raw["baseline"][s], raw[arm][s]) for s in seeds}
            endpoints = arm_endpoints(raw["baseline"], {s: raw[arm][s] for s in seeds})
            arms[arm] = {
                "label": label,
                "endpoints": endpoints,
                "decision": decide(endpoints["endpoints"]["plateau"], endpoints["late_rescues"]["mean"]).to_json(),
                "per_seed": figures,
                "paired": paired(list(figures.values())),
                "costs": costs(cfg, raw, arm, figures),
            }
    summary: dict[str, Any] = {
        "protocol": cfg.model_dump(mode="json"),
        "warmup": raw["warmup"],
        "pool": raw["pool"],
        "per_seed": per_seed,
        "paired": paired(list(per_seed.values())),
        "eval_standard_error_at_baseline_peak": eval_standard_error(
            cfg, statistics.mean(f["baseline_peak"] for f in per_seed.values())
        ),
        "wall_seconds": raw["wall_seconds"],
        "machines": machines(raw),
        "arms": arms,
        "runs": {arm: raw[arm] for arm in ("baseline", *arms)},
        "replay_signal": {
            f"{arm}-s{s}": signal
            for arm in arms
            for s in seeds
            if (signal := replay_signal_over_training(raw[arm][s])) is not None
        },
    }
    if "ablations" in raw:
        summary["ablations"] = ablation_cells(raw, seeds[: cfg.ablation_seeds])
        summary["ablation_endpoints"] = ablation_endpoint_figures(raw, seeds[: cfg.ablation_seeds])
        summary["pool_other_rule"] = raw.get("pool_other_rule")
        summary["pool_half"] = raw.get("pool_half")
    cfg.results.parent.mkdir(parents=True, exist_ok=True)
    cfg.results.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(raw, seeds, cfg.results.with_suffix(".png"))
    print_tables(summary, Console(width=200))
    return summary


def machines(raw: dict) -> dict[str, list[str]]:
    """Run ids (and the pool's collection, priced in the cost line) by the machine that timed them ("not recorded"
    for those from before they kept it)."""
    runs = [run for arm in ("baseline", *ARMS) if arm in raw for run in raw[arm].values()]
    runs += [run for cell in raw.get("ablations", {}).values() for run in cell.get("runs", {}).values()]
    if "pool" in raw:
        runs.append(raw["pool"] | {"run_id": "pool collection"})
    out: dict[str, list[str]] = {}
    for run in runs:
        out.setdefault(run.get("machine", "not recorded"), []).append(run["run_id"])
    return out


def ablation_cells(raw: dict, seeds: list[int]) -> dict[str, dict]:
    """Each cell against the baseline of the same seeds; first, the protocol's RLEP on those seeds (the reference
    each cell changes one thing of). A cell with fewer finished seeds than `seeds` is listed, not reported: issue 29
    asks >= 3 seeds of a cell before it counts as a finding, and a bootstrap over one or two seeds says nothing."""
    reference = {"runs": {s: raw["rlep"][s] for s in seeds}}
    cells = {}
    for name, cell in {"RLEP as run (M=2, uniform, >= 2 correct)": reference, **raw["ablations"]}.items():
        if "not_run" in cell:
            cells[name] = cell
            continue
        if len(cell["runs"]) < len(seeds):
            done = ", ".join(run["run_id"] for run in cell["runs"].values())
            why = f"{len(cell['runs'])} of {len(seeds)} seeds finished ({done}): no finding yet"
            cells[name] = {"not_run": why, "seeds_finished": len(cell["runs"])}
            continue
        figures = [run_figures(raw["baseline"][s], run) for s, run in cell["runs"].items()]
        cells[name] = {
            "seeds": len(figures),
            "replayed_rows_per_step": replayed_rows(cell["runs"]),
            "step_seconds": statistics.mean(x for run in cell["runs"].values() for x in run["step_seconds"]),
            **paired(figures),
        }
    return cells


def ablation_endpoint_figures(raw: dict, seeds: list[int]) -> dict | None:
    """The named endpoints of the cells that finished all `seeds` (exploratory, Holm across them); None if none."""
    cells = {
        name: cell["runs"]
        for name, cell in raw["ablations"].items()
        if "runs" in cell and len(cell["runs"]) == len(seeds)
    }
    if not cells:
        return None
    return ablation_endpoints(raw["baseline"], cells, {s: raw["rlep"][s] for s in seeds})


def replayed_rows(runs: dict) -> float:
    """Replayed rows a step actually trained on, mean over the cell's runs and steps: the pool serves at most its
    distinct successes of a question, so M replayed rows asked for may be fewer given (M=4 on a pool of ~1.2 each)."""
    return statistics.mean(
        f * n for run in runs.values() for f, n in zip(run["replayed_fraction"], run["sequences"], strict=True)
    )


SIGNAL = ("replay_advantage_share", "replay_signal_groups", "replay_sequence_prob_mean", "fresh_accuracy")


def replay_signal_over_training(run: dict, parts: int = 4) -> list[dict] | None:
    """What replay could teach in each quarter of a run (services/learner/replay_signal.py): per quarter of its
    steps, the mean advantage share of replayed rows, groups rescued per step, the chance the policy samples a
    replayed answer itself, and the fresh rows' accuracy. None for runs recorded before these figures."""
    if not run.get("replay_advantage_share") or run["replay_advantage_share"][0] is None:
        return None
    n = len(run["replay_advantage_share"])
    out = []
    for part in range(parts):
        lo, hi = n * part // parts, n * (part + 1) // parts
        row = {"steps": [lo + 1, hi]}
        for name in SIGNAL:
            values = [v for v in run[name][lo:hi] if v is not None]
            row[name] = statistics.mean(values) if values else None
        out.append(row)
    return out


def mean_band(runs: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """Steps evaluated by every run, the mean accuracy there, and the SD across runs (0 for one run)."""
    common = sorted(set.intersection(*({s for s, _ in r["curve"]} for r in runs)))
    values = [[dict(map(tuple, r["curve"]))[s] for r in runs] for s in common]
    return common, [statistics.mean(v) for v in values], [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]


def plot(raw: dict, seeds: list[int], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lines = (("baseline", "baseline (M=0)", "tab:blue"), ("rlep", "RLEP (replay)", "tab:orange"))
    lines += (("rlep_equal", "RLEP, equal updates", "tab:green"),) if "rlep_equal" in raw else ()
    for arm, label, color in lines:
        steps, mean, sd = mean_band([raw[arm][s] for s in seeds])
        ax.plot(steps, mean, marker="o", markersize=3, color=color, label=f"{label}, mean of {len(seeds)} seeds")
        ax.fill_between(
            steps,
            [m - d for m, d in zip(mean, sd, strict=True)],
            [m + d for m, d in zip(mean, sd, strict=True)],
            color=color,
            alpha=0.2,
        )
        # Each seed whole (seeds stop at their own plateau): the mean ends where the shortest does.
        for s in seeds:
            ax.plot(*zip(*raw[arm][s]["curve"], strict=True), color=color, linewidth=0.7, alpha=0.45)
    peaks = [peak(raw["baseline"][s]["curve"]) for s in seeds]
    ax.axhline(
        statistics.mean(a for _, a in peaks), color="grey", linestyle=":", label="baseline peak (mean over seeds)"
    )
    ax.set_xlabel("training step (thin: each seed to its stop; thick: mean while every seed runs)")
    ax.set_ylabel("held-out accuracy (T=1), band = ±1 SD over seeds")
    ax.set_title("RLEP vs baseline from one shared warm-up model")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _median(row: dict) -> str:
    if not row.get("n"):
        return "n/a"
    never = f"{row['censored']}/{row['n']} seeds never got there"
    if row["median"] is None:  # more than half the seeds never reached the peak: the median lies beyond the runs
        return f"none ({never})"
    return f"{row['median']:.2f} ({never})"


def _ci(row: dict, digits: int = 3) -> str:
    """The mean, its primary interval (t95 for n <= 10) and the other beside it, e.g. `+0.005 t[...] boot(...)`."""
    if not row.get("n"):
        return "n/a"
    if row["n"] == 1:  # one pair: a difference, no interval
        return f"{row['diff']:+.{digits}f} (1 seed)"
    sign = "" if row.get("ratio") else "+"
    t = f"t[{row['t_low']:{sign}.{digits}f}, {row['t_high']:{sign}.{digits}f}]"
    boot = f"boot[{row['boot_low']:{sign}.{digits}f}, {row['boot_high']:{sign}.{digits}f}]"
    primary, beside = (t, boot) if row["method"] == "t" else (boot, t)
    # A ratio is judged against 1, not 0; the star follows the primary interval.
    star = " *" if row.get("below_one" if row.get("ratio") else "excludes_zero") else ""
    return f"{row['diff']:{sign}.{digits}f} {primary} {beside.replace('[', '(').replace(']', ')')}{star}"


def print_tables(summary: dict, console: Console) -> None:
    for arm in summary["arms"].values():  # the decision and the named endpoints lead
        print_endpoints(arm["label"], arm["endpoints"], arm["decision"], console)
    for arm in summary["arms"].values():
        print_arm(arm, console)
    pool = summary["pool"]
    console.print(
        f"pool ({pool['rule']}, N={pool['samples_per_question']}): coverage {pool['coverage']:.1%} of training "
        f"questions, {pool['successes_per_question']:.2f} distinct successes and {pool['paths_per_question']:.2f} "
        f"solution paths per pooled question, {pool['multi_path_share']:.1%} with >= 2 paths; collection success "
        f"rate {pool['success_rate']:.1%}. Eval SE at the baseline peak: "
        f"{summary['eval_standard_error_at_baseline_peak']:.4f}. Wall time "
        + (f"{summary['wall_seconds'] / 60:.1f} min." if summary["wall_seconds"] else "not recorded.")
    )
    if len(summary["machines"]) > 1:  # step times, their paired differences and the costs mix these machines
        console.print(
            f"step times come from {len(summary['machines'])} machines (times and costs mix them): "
            + "; ".join(f"{name}: {len(runs)} runs" for name, runs in summary["machines"].items())
        )
    if summary["replay_signal"]:
        print_replay_signal(summary["replay_signal"], console)
    if "ablations" in summary:
        print_ablations(summary["ablations"], console)
    if summary.get("ablation_endpoints"):
        print_ablation_endpoints(summary["ablation_endpoints"], console)


def print_replay_signal(runs: dict[str, list[dict]], console: Console) -> None:
    table = Table(title="what replay could teach, by quarter of each run (services/learner/replay_signal.py)")
    columns = ("run", "steps", "replayed share of |A|", "groups rescued / step", "P(policy samples it)", "fresh acc")
    for column in columns:
        table.add_column(column, justify="right")
    for run, quarters in runs.items():
        for q in quarters:
            table.add_row(
                run,
                f"{q['steps'][0]}-{q['steps'][1]}",
                _fmt(q["replay_advantage_share"]),
                _fmt(q["replay_signal_groups"], 2),
                _fmt(q["replay_sequence_prob_mean"]),
                _fmt(q["fresh_accuracy"]),
            )
    console.print(table)


def print_arm(arm: dict, console: Console) -> None:
    """One RLEP arm against the baseline: per seed, paired, and what it cost with phase 1."""
    label = arm["label"]
    seeds = Table(title=f"{label} vs baseline, per seed (held-out accuracy at T=1; as many steps as the baseline)")
    for column in (
        "seed",
        "baseline steps (stopped by)",
        "baseline peak (step)",
        "RLEP reaches it at",
        "ratio",
        "ratio at 50 / 75 / 90% of its gain",
        "RLEP peak (step)",
        "final B / R",
        "mean acc B / R",
    ):
        seeds.add_column(column, justify="right")
    for seed, f in arm["per_seed"].items():
        seeds.add_row(
            str(seed),
            f"{f['baseline_steps']} ({f['baseline_plateau_step'] or f.get('baseline_stopped_by', 'cap')})",
            f"{f['baseline_peak']:.3f} ({f['baseline_peak_step']})",
            "not reached" if f["rlep_steps_to_baseline_peak"] is None else str(f["rlep_steps_to_baseline_peak"]),
            _fmt(f["steps_ratio"], 2),
            " / ".join(_fmt(r, 2) for r in f["steps_ratio_to_gain"].values()),
            f"{f['rlep_peak']:.3f} ({f['rlep_peak_step']})",
            f"{f['baseline_final']:.3f} / {f['rlep_final']:.3f}",
            f"{f['baseline_auc']:.3f} / {f['rlep_auc']:.3f}",
        )
    console.print(seeds)
    table = Table(
        title=f"paired over seeds: {label} - baseline (the baseline's own stopping step; peak and steps to it are "
        "secondary, noise-sensitive), mean t\\[95% CI, df = n-1] boot(percentile bootstrap 95%, under-covers at "
        "n <= 10) (* primary interval excludes 0; a ratio: below 1)"
    )
    for column in ("figure", "baseline", "RLEP", "difference", "n"):
        table.add_column(column, justify="right")
    for name, row in arm["paired"].items():
        if "reached" in row:
            table.add_row(name, "", "", f"{row['reached']}/{row['seeds']}", "")
        elif "median" in row:
            table.add_row(name, "1", "", _median(row), str(row["n"]))
        elif row.get("ratio"):
            table.add_row(name + " (seeds that reach it)", "1", "", _ci(row, 2), str(row["n"]))
        elif row.get("n"):
            table.add_row(name, _fmt(row["baseline_mean"]), _fmt(row["rlep_mean"]), _ci(row), str(row["n"]))
    console.print(table)
    c = arm["costs"]
    saved, runs = c["seconds_saved_to_baseline_peak"], c["runs_to_break_even"]
    if saved is None:
        saving = "no seed reached the baseline's peak, so no time is saved."
    else:
        repaid = f"after {runs} runs that reuse it." if runs else "never (no time saved)."
        saving = (
            f"training time to the baseline's peak saved per run: {saved:.0f} s "
            f"(mean over the {c['seeds_reaching_baseline_peak']} of {c['seeds']} seeds that reach it; the others save "
            f"nothing, they never get there); the pool pays for itself, in those, {repaid}"
        )
    console.print(
        f"cost: the pool took {c['pool_seconds'] / 60:.1f} min = {c['pool_in_baseline_steps']:.0f} baseline steps "
        f"(phase 1: {c['phase1_steps']} steps, collection {c['collection_seconds']:.0f} s); step time "
        f"{c['step_seconds']['baseline']:.2f} s baseline / {c['step_seconds']['arm']:.2f} s; {saving}"
    )


def print_ablations(cells: dict, console: Console) -> None:
    table = Table(
        title="ablations (exploratory): variant - baseline (same seeds), mean t\\[95% CI] boot(bootstrap 95%); "
        "peak and steps secondary, noise-sensitive"
    )
    columns = ("cell", "seeds", "replayed rows / step", "step s", "peak", "final", "mean acc", "reached B peak")
    for column in (*columns, "ratio (reaching)", "median ratio"):
        table.add_column(column, justify="right")
    for name, cell in cells.items():
        if "not_run" in cell:
            why = "not reported: " + cell["not_run"][:60] + "…"
            table.add_row(name, str(cell.get("seeds_finished", 0)), "", "", why, "", "", "", "", "")
            continue
        reach = cell["seeds where RLEP reached the baseline's peak"]
        ratio = cell["RLEP steps / baseline steps to its peak"]
        table.add_row(
            name,
            str(cell["seeds"]),
            f"{cell['replayed_rows_per_step']:.1f}",
            f"{cell['step_seconds']:.2f}",
            _ci(cell["peak accuracy"]),
            _ci(cell["final accuracy"]),
            _ci(cell["mean accuracy (AUC / steps)"]),
            f"{reach['reached']}/{reach['seeds']}",
            _fmt(ratio.get("diff"), 2),
            _median(cell[MEDIAN_RATIO]),
        )
    console.print(table)
