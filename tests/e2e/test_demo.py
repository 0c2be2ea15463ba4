"""`rlep demo` end to end in miniature: warm-up, baseline, collection, RLEP, table, plot, results.

Small sizes keep it to a couple of minutes; the real figures come from `rlep demo` itself and
benchmarks/rlep_vs_baseline.py. What this pins down is the protocol's wiring: both runs start from
the warm-up checkpoint (not the untrained model), the replay pool is filled from the baseline and
read by RLEP only, and the outputs are written.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlep.services.learner.records import StepRecord, read_step_log
from tests.tracking_util import jsonl_scalars, read_scalars

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5


@pytest.fixture(scope="module")
def demo_run(ray_local, tmp_path_factory):
    from rlep.services.demo.runner import load_demo_config, run_demo

    out = tmp_path_factory.mktemp("demo")
    # configs/demo.yaml with smaller sizes (its lr, response length and training settings are kept).
    sizes = dict(
        seed=5,
        out_dir=out,
        warmup_steps=150,
        train_questions=48,
        eval_questions=32,
        steps=3,
        eval_every=1,
        questions_per_step=8,
        fresh_per_question=4,
        replayed_per_question=2,
        collect_samples=8,
    )
    config = load_demo_config(flags=sizes)
    return config, run_demo(config, show_progress=False)


def test_demo_writes_table_plot_and_results(demo_run):
    config, summary = demo_run
    saved = json.loads((config.out_dir / "results.json").read_text())
    assert saved["seed"] == 5 and saved["config"]["steps"] == 3
    assert (config.out_dir / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Step 0 (the warm-up model) plus an evaluation after every step, for both runs.
    assert [s for s, _ in saved["baseline_curve"]] == [0, 1, 2, 3] == [s for s, _ in saved["rlep_curve"]]
    assert saved["baseline_peak"] == max(a for _, a in saved["baseline_curve"])
    # Same warm-up model, same seed, same evaluation: both curves start at the same point.
    assert saved["baseline_curve"][0] == saved["rlep_curve"][0]
    for run in ("baseline", "rlep"):  # the table's step time is the mean of the run's logged step times
        log = read_step_log(config.out_dir / run / "log.jsonl")
        times = [r.step_seconds for r in log if isinstance(r, StepRecord)]
        assert len(times) == config.steps
        assert summary[f"{run}_step_seconds"] == pytest.approx(sum(times) / len(times))
        # Each evaluation keeps its correct samples per held-out question (issue 49), adding up to its accuracy.
        evaluations = [r for r in log if r.eval_accuracy is not None]
        assert [len(r.eval_correct) for r in evaluations] == [config.eval_questions] * (config.steps + 1)
        for r in evaluations:
            assert sum(r.eval_correct) == round(r.eval_accuracy * config.eval_questions * config.eval_samples)


def test_each_run_logs_its_jsonl_figures_to_tensorboard(demo_run):
    """Under <out_dir>/<run>/tensorboard, per step and name, the step-0 evaluation included."""
    config, _ = demo_run
    for run in ("baseline", "rlep"):
        scalars = read_scalars(config.out_dir / run / "tensorboard")
        expected = jsonl_scalars(read_step_log(config.out_dir / run / "log.jsonl"))
        assert scalars.keys() == expected.keys(), run
        for name, by_step in expected.items():
            assert scalars[name] == pytest.approx(by_step, rel=1e-6), (run, name)
        assert sorted(scalars["eval_accuracy"]) == list(range(config.steps + 1))


def test_both_runs_start_from_the_warmup_checkpoint(demo_run):
    """RL moves the weights a little from where it starts; the untrained model is far from there."""
    from safetensors.torch import load_file

    from rlep.common.tiny_model import cached_model

    config, _ = demo_run
    untrained = load_file(str(cached_model("tiny") / "model.safetensors"))
    warm = load_file(str(config.out_dir / "warmup" / "model.safetensors"))
    for run in ("baseline", "rlep"):
        final = load_file(str(config.out_dir / run / f"step_{config.steps}" / "hf" / "model.safetensors"))
        assert _distance(final, warm) < 0.1 * _distance(final, untrained), run


def test_rlep_replays_what_the_baseline_collected(demo_run):
    config, summary = demo_run
    baseline = [r for r in read_step_log(config.out_dir / "baseline" / "log.jsonl") if isinstance(r, StepRecord)]
    rlep = [r for r in read_step_log(config.out_dir / "rlep" / "log.jsonl") if isinstance(r, StepRecord)]
    assert all(r.replayed_fraction == 0.0 for r in baseline)
    # Issue 48: the RLEP run tells the pool's history every step's groups; the baseline (M = 0) has no pool to tell.
    assert all(r.history_status is None for r in baseline)
    assert [(r.history_status, r.history_recorded) for r in rlep] == [("recorded", r.questions_generated) for r in rlep]
    assert all(r.replay_offered == config.questions_per_step and not r.replay_skipped for r in rlep)  # `always`
    assert summary["collect"]["questions_kept"] > 0, "the warm-up model should solve some training questions"
    assert any(r.replayed_fraction > 0.0 for r in rlep)
    cap = config.replayed_per_question / (config.fresh_per_question + config.replayed_per_question)
    assert all(r.replayed_fraction <= cap + 1e-9 for r in rlep)
