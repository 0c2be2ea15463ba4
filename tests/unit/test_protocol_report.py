"""The protocol (rlep.experiments.protocol), its figures and its report, pure parts: where the half-trained pool
comes from, what an RLEP arm costs once phase 1 is counted (issue 29: a user deciding whether to run it asks when
it breaks even), and how its steps compare with the baseline's."""

from __future__ import annotations

from rlep.experiments.protocol import figures, report
from rlep.experiments.protocol.archive import archive_finished
from rlep.experiments.protocol.config import ProtocolConfig, run_config
from rlep.experiments.protocol.finished import finished_runs
from rlep.experiments.protocol.pool import machine
from rlep.experiments.protocol.run import half_checkpoint
from rlep.experiments.protocol.training import train_run


def test_the_half_trained_pool_comes_from_the_evaluation_at_half_the_first_baseline(tmp_path):
    cfg = ProtocolConfig(seeds=[3, 4], eval_every=20, work_dir=tmp_path, archive=None)
    assert half_checkpoint(cfg, 180) == tmp_path / "baseline-s3" / "step_80" / "hf"
    assert half_checkpoint(cfg, 20) == tmp_path / "baseline-s3" / "step_20" / "hf"  # never before the first
    first = run_config(cfg, "baseline-s3", 3, 600, tmp_path, "p", {}).checkpoint
    other = run_config(cfg, "baseline-s4", 4, 600, tmp_path, "p", {}).checkpoint
    assert (first.every_steps, first.keep_last) == (20, 30)  # a checkpoint at every evaluation
    assert (other.every_steps, other.keep_last) == (600, 1)


def test_the_equal_updates_arm_sizes_mini_batches_over_all_rows(tmp_path):
    cfg = ProtocolConfig(work_dir=tmp_path)
    extra = {"algorithm": {"mini_batch_rows": "all"}}
    algo = run_config(cfg, "rlep-equal-s0", 0, 100, tmp_path, "p", extra).algorithm
    assert algo.mini_batch_size == cfg.mini_batch_questions * (cfg.fresh_per_question + cfg.replayed_per_question)


def test_costs_count_phase_1_and_the_runs_it_takes_to_pay_for_the_pool(tmp_path):
    cfg = ProtocolConfig(seeds=[0, 1], work_dir=tmp_path)
    curve = [[0, 0.1], [2, 0.5], [4, 0.4]]
    baseline = {s: {"steps": 4, "curve": curve, "plateau_step": 4, "step_seconds": [10.0] * 4} for s in (0, 1)}
    rlep = {s: {"steps": 4, "curve": [[0, 0.1], [1, 0.5], [4, 0.6]], "step_seconds": [12.0] * 4} for s in (0, 1)}
    raw = {"baseline": baseline, "rlep": rlep, "pool": {"seconds": 20.0}}
    reached = {s: {"baseline_peak_step": 2, "rlep_steps_to_baseline_peak": 1} for s in (0, 1)}
    costs = report.costs(cfg, raw, "rlep", reached)
    assert costs["pool_seconds"] == 60.0 and costs["pool_in_baseline_steps"] == 6.0  # 40 s of phase 1 + 20 s
    assert costs["seconds_saved_to_baseline_peak"] == 8.0  # 20 s for the baseline, 12 s for RLEP
    assert costs["runs_to_break_even"] == 8  # ceil(60 / 8)
    assert costs["step_seconds"] == {"baseline": 10.0, "arm": 12.0}

    slower = {s: {"baseline_peak_step": 2, "rlep_steps_to_baseline_peak": 2} for s in (0, 1)}  # 24 s > 20 s
    assert report.costs(cfg, raw, "rlep", slower)["runs_to_break_even"] is None
    never = {s: {"baseline_peak_step": 2, "rlep_steps_to_baseline_peak": None} for s in (0, 1)}
    assert report.costs(cfg, raw, "rlep", never)["seconds_saved_to_baseline_peak"] is None
    half = {0: reached[0], 1: never[1]}  # the saving is a mean over the seeds that get there: say how many do
    assert {k: report.costs(cfg, raw, "rlep", half)[k] for k in ("seeds_reaching_baseline_peak", "seeds")} == {
        "seeds_reaching_baseline_peak": 1,
        "seeds": 2,
    }


def test_finished_runs_and_their_checkpoints_resume_on_another_machine_from_the_archive(tmp_path):
    """A protocol outlives a machine (issue 29: ~4 h of 2 cores): what finished on one resumes from the committed
    archive on another, with the checkpoints its pools come from, and is reported there."""
    import json

    here, archive, elsewhere = tmp_path / "here", tmp_path / "archive", tmp_path / "elsewhere"
    results = {"baseline-s0": {"steps": 80, "seed": 0}, "rlep-s0": {"steps": 80, "seed": 0}}
    for run_id, result in results.items():
        (here / run_id).mkdir(parents=True)
        (here / run_id / "result.json").write_text(json.dumps({"run_id": run_id, "curve": [[0, 0.1]], **result}))
    for step in (40, 80):
        hf = here / "baseline-s0" / f"step_{step}" / "hf"
        hf.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (hf / name).write_text(f"{name} at {step}")
    (here / "pool-protocol-phase1.json").write_text(json.dumps({"questions": 7}))
    cfg = ProtocolConfig(seeds=[0], eval_every=20, work_dir=here, archive=archive, equal_updates_arm=False)
    saved = archive_finished(archive, here, tmp_path / "no-warmup", "baseline-s0", lambda n: n // 2)
    assert "models/baseline-s0-step_40" in saved and "results/rlep-s0.json" in saved

    moved = cfg.model_copy(update={"work_dir": elsewhere})
    half = half_checkpoint(moved, 80)  # restored where the collection of the half-trained pool reads it
    assert (half / "model.safetensors").read_text() == "model.safetensors at 40"
    _, out = finished_runs(moved, ablations=False)
    assert out["baseline"][0]["steps"] == out["rlep"][0]["steps"] == 80 and out["pool"] == {"questions": 7}
    config = run_config(moved, "rlep-s0", 0, 80, tmp_path, "p", {})
    assert train_run(config, stack=None, stop_at_plateau=None, archive=archive)["run_id"] == "rlep-s0"  # not rerun


def test_steps_are_compared_along_the_baselines_climb_not_only_at_its_peak():
    # Baseline 0.2 -> 0.6 (peak at 80): half its gain is 0.4 (step 40), 75% 0.5 (step 60), 90% 0.56 (step 80).
    base = [(0, 0.2), (20, 0.3), (40, 0.41), (60, 0.52), (80, 0.6), (100, 0.55)]
    rlep = [(0, 0.2), (20, 0.42), (40, 0.51), (60, 0.55), (80, 0.57), (100, 0.58)]
    ratios = figures.gain_ratios(base, rlep)
    assert ratios == {"50%": 20 / 40, "75%": 40 / 60, "90%": 80 / 80}
    seed = figures.run_figures(
        {"curve": base, "steps": 100, "plateau_step": None, "step_seconds": [1.0], "response_tokens": [1.0]},
        {"curve": rlep, "step_seconds": [1.0], "response_tokens": [1.0], "replayed_fraction": [0.2]},
    )
    assert seed["steps_ratio"] is None  # never reaches the peak 0.6, though it climbs faster
    assert seed["steps_ratio_to_gain"] == ratios


def test_a_step_ratio_is_starred_only_when_its_interval_lies_below_one():
    """The target is a ratio's upper end below 1; every ratio excludes 0, so "excludes 0" said nothing about it."""
    faster = figures._ratio([0.5, 0.6, 0.7])
    mixed = figures._ratio([0.5, 1.2, 0.9])
    assert faster["below_one"] and faster["high"] < 1 and report._ci(faster, 2).endswith(" *")
    assert not mixed["below_one"] and mixed["low"] < 1 <= mixed["high"] and not report._ci(mixed, 2).endswith("*")
    assert not figures._ratio([0.5])["below_one"]  # one seed: a ratio, no interval


def test_the_report_says_which_machine_timed_each_run():
    """Runs resumed on another machine time their steps there: the report must not pass mixed times off as one."""
    here = machine()
    assert here.endswith("cores") and here != "not recorded"
    raw = {
        "baseline": {0: {"run_id": "baseline-s0"}, 1: {"run_id": "baseline-s1", "machine": here}},
        "rlep": {0: {"run_id": "rlep-s0"}, 1: {"run_id": "rlep-s1", "machine": here}},
        "ablations": {"M=1": {"runs": {0: {"run_id": "abl-M-1-s0", "machine": here}}}, "x": {"not_run": "why"}},
        "pool": {"seconds": 48.0, "machine": "another"},  # collected again by the session that resumed
    }
    assert report.machines(raw) == {
        "not recorded": ["baseline-s0", "rlep-s0"],
        here: ["baseline-s1", "rlep-s1", "abl-M-1-s0"],
        "another": ["pool collection"],
    }


def test_seeds_that_never_reach_the_peak_count_in_the_median_step_ratio():
    """A mean over the seeds that reach the baseline's peak flatters an arm that often never gets there."""
    base = {"curve": [(0, 0.2), (50, 0.5), (100, 0.4)], "steps": 100, "plateau_step": 100}
    base |= {"step_seconds": [1.0], "response_tokens": [1.0]}
    fast = {"curve": [(0, 0.2), (25, 0.5), (100, 0.5)], "step_seconds": [1.0], "response_tokens": [1.0]}
    never = fast | {"curve": [(0, 0.2), (25, 0.45), (100, 0.45)], "replayed_fraction": [0.2]}
    fast |= {"replayed_fraction": [0.2]}
    seeds = [figures.run_figures(base, fast)] + [figures.run_figures(base, never) for _ in range(2)]
    assert seeds[0]["steps_ratio"] == 0.5 and seeds[1]["steps_ratio_censored_at"] == 100 / 50
    paired = figures.paired(seeds)
    assert paired["RLEP steps / baseline steps to its peak"]["diff"] == 0.5  # the one seed that got there
    median = paired[figures.MEDIAN_RATIO]
    assert median == {"median": None, "n": 3, "censored": 2}
    assert report._median(median) == "none (2/3 seeds never got there)"
    assert figures.paired(seeds[:1] * 2 + seeds[1:2])[figures.MEDIAN_RATIO]["median"] == 0.5


def test_an_ablation_cell_says_how_many_replayed_rows_its_steps_got():
    """M=4 asks for 4 rows per question; a pool holding one distinct success of most questions gives fewer."""
    runs = {
        0: {"replayed_fraction": [0.1, 0.2], "sequences": [100, 150]},
        1: {"replayed_fraction": [0.0], "sequences": [90]},
    }
    assert report.replayed_rows(runs) == (10 + 30 + 0) / 3


def test_an_ablation_cell_short_of_its_seeds_is_listed_not_reported():
    """A cell of one finished seed (the rest still to run) must not print figures that read as a finding."""
    per_step = {"step_seconds": [1.0], "response_tokens": [100], "replayed_fraction": [0.1], "sequences": [10]}
    curve = {"curve": [[0, 0.2], [20, 0.4], [40, 0.5]], "steps": 40, "plateau_step": 40, **per_step}
    raw = {
        "baseline": {s: {"run_id": f"baseline-s{s}", **curve} for s in (0, 1, 2)},
        "rlep": {s: {"run_id": f"rlep-s{s}", **curve} for s in (0, 1, 2)},
        "ablations": {
            "partial": {"runs": {0: {"run_id": "abl-partial-s0", **curve}}},
            "whole": {"runs": {s: {"run_id": f"abl-whole-s{s}", **curve} for s in (0, 1, 2)}},
        },
    }
    cells = report.ablation_cells(raw, [0, 1, 2])
    why = "1 of 3 seeds finished (abl-partial-s0): no finding yet"
    assert cells["partial"] == {"not_run": why, "seeds_finished": 1}
    assert cells["whole"]["seeds"] == 3 and "peak accuracy" in cells["whole"]
