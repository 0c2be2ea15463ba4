"""Step records: the JSONL line a step writes (keys, order, optional fields) and its reading back, and the
learner gauges they feed."""

from __future__ import annotations

import dataclasses
import json

from prometheus_client import CollectorRegistry, generate_latest

from rlep.services.learner.metrics import STEP_GAUGES, LearnerMetrics
from rlep.services.learner.records import EvalRecord, StepRecord, format_record, read_step_log

# The on-disk contract: these keys, in this order (the demo and dashboards read the log by key).
STEP_KEYS = [
    "step", "policy_version", "reward_mean", "fresh_accuracy", "replayed_fraction",
    "replay_requested", "replay_received", "replay_used", "replay_retokenized", "replay_truncated",
    "replay_failed_verification", "replay_dropped", "advantage_mean", "advantage_std",
    "clip_fraction", "approx_kl", "entropy", "loss", "lr", "optimizer_steps", "response_length_mean",
    "sequences", "prompts_truncated", "generation_rounds", "questions_generated", "groups_filtered",
    "step_seconds", "phase_seconds", "question_ids", "policy_staleness_max", "policy_staleness_mean",
    "groups_dropped_stale",
    "rollout_replicas",
    "rollout_failovers",
    "scorer_failures",
    "replay_offered",
    "replay_skipped",
    "replay_rescued_groups",
    "replay_traces",
]  # fmt: skip


def step_record(**changes) -> StepRecord:
    record = StepRecord(
        step=3,
        policy_version=7,
        reward_mean=0.25,
        fresh_accuracy=0.5,
        replayed_fraction=1 / 3,
        replay_requested=4,
        replay_received=4,
        replay_used=3,
        replay_retokenized=1,
        replay_truncated=0,
        replay_failed_verification=1,
        replay_dropped={"empty_answer": 1},
        advantage_mean=0.0,
        advantage_std=0.9,
        clip_fraction=0.01,
        approx_kl=0.002,
        entropy=1.5,
        loss=-0.1,
        lr=1e-4,
        optimizer_steps=6.0,
        response_length_mean=12.5,
        sequences=12,
        prompts_truncated=0,
        generation_rounds=1,
        questions_generated=2,
        groups_filtered=0,
        step_seconds=4.5,
        phase_seconds={"rollout": 1.0, "verify": 0.5, "replay": 0.25, "train": 2.5, "weight_push": 0.25},
        question_ids=["q1", "q2"],
    )
    return dataclasses.replace(record, **changes)


def test_a_step_line_has_the_logged_keys_in_order_and_eval_accuracy_only_when_evaluated():
    assert list(json.loads(format_record(step_record()))) == STEP_KEYS
    evaluated = json.loads(format_record(step_record(eval_accuracy=0.4)))
    assert list(evaluated) == [*STEP_KEYS, "eval_accuracy"] and evaluated["eval_accuracy"] == 0.4
    assert json.loads(format_record(step_record(optimizer_steps=None)))["optimizer_steps"] is None
    measured = json.loads(format_record(step_record(rollout_mismatch_kl=0.01, kl_ref=0.2)))
    assert list(measured) == [*STEP_KEYS, "rollout_mismatch_kl", "kl_ref"] and measured["kl_ref"] == 0.2
    assert json.loads(format_record(EvalRecord(step=0, policy_version=2, eval_accuracy=0.1))) == {
        "step": 0,
        "policy_version": 2,
        "eval_accuracy": 0.1,
    }


def test_a_step_log_reads_back_as_the_records_written(tmp_path):
    written = [EvalRecord(step=0, policy_version=1, eval_accuracy=0.2), step_record(), step_record(eval_accuracy=0.5)]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(format_record(r) + "\n" for r in written))
    assert read_step_log(path) == written


def test_every_gauge_is_a_record_field_and_shows_the_last_record():
    fields = {f.name for f in dataclasses.fields(StepRecord)}
    assert set(STEP_GAUGES) <= fields
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry)
    metrics.record(step_record())
    assert metrics.gauges["replay_used"]._value.get() == 3
    assert metrics.step_seconds.labels("train")._value.get() == 2.5
    # No evaluation yet (periodic eval off, or not its step): the series is absent, not 0.0.
    assert registry.get_sample_value("rlep_learner_eval_accuracy") is None
    assert b"rlep_learner_eval_accuracy" not in generate_latest(registry)
    metrics.record(EvalRecord(step=0, policy_version=9, eval_accuracy=0.3))
    assert registry.get_sample_value("rlep_learner_eval_accuracy") == 0.3
    assert metrics.gauges["policy_version"]._value.get() == 9
    assert metrics.gauges["replay_used"]._value.get() == 3
    assert metrics.phase_seconds.labels("train")._value.get() == 2.5  # counted once, by the step
    metrics.record(step_record(step=4))  # a step without an evaluation leaves the last one shown
    assert registry.get_sample_value("rlep_learner_eval_accuracy") == 0.3
    metrics.record(step_record(step=5, eval_accuracy=0.0))
    assert registry.get_sample_value("rlep_learner_eval_accuracy") == 0.0  # a measured 0 is shown


def test_an_evaluation_keeps_its_correct_samples_per_question_and_old_logs_still_read(tmp_path):
    """Issue 49: each evaluation logs its correct samples per held-out question; a log written before the field (an
    evaluation line of three keys) still reads back as an evaluation."""
    evaluated = step_record(eval_accuracy=0.5, eval_correct=[2, 0, 1, 1])
    initial = EvalRecord(step=0, policy_version=1, eval_accuracy=0.25, eval_correct=[1, 0, 0, 1])
    assert list(json.loads(format_record(evaluated)))[-2:] == ["eval_accuracy", "eval_correct"]
    path = tmp_path / "log.jsonl"
    old_line = json.dumps({"step": 0, "policy_version": 1, "eval_accuracy": 0.25})
    path.write_text("\n".join([old_line, format_record(initial), format_record(evaluated)]) + "\n")
    assert read_step_log(path) == [EvalRecord(step=0, policy_version=1, eval_accuracy=0.25), initial, evaluated]
