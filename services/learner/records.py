"""What the learner logs per step: `StepRecord` (a training step) and `EvalRecord` (the evaluation of the
starting weights, step 0), their JSONL form and the reading of a step log back.

The JSONL form is a contract (the demo compares logs of runs, dashboards read them): one JSON object per
line, keys in field order, `eval_accuracy` present only on the steps that evaluated and the other figures of
`ABSENT_WHEN_NONE` only where measured.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EvalRecord", "LogRecord", "StepRecord", "format_record", "parse_record", "read_step_log"]


@dataclass(frozen=True)
class StepRecord:
    """One training step, as `Trainer.train_step` returns and logs it."""

    step: int
    """Training steps completed, this one included."""
    policy_version: int
    """Weight version pushed to rollout after this step."""
    reward_mean: float
    """Mean reward of the step's fresh samples (shaping included)."""
    fresh_accuracy: float
    """Fraction of the step's fresh samples verified correct."""
    replayed_fraction: float
    """Replayed responses / all responses trained on."""
    replay_requested: int
    replay_received: int
    replay_used: int
    replay_retokenized: int
    replay_truncated: int
    replay_failed_verification: int
    replay_dropped: dict[str, int]
    """Replayed answers left out, by reason (`experience.ReplayReport`)."""
    advantage_mean: float
    advantage_std: float
    clip_fraction: float
    approx_kl: float
    entropy: float
    loss: float
    lr: float
    optimizer_steps: float | None
    """Optimizer steps since the start of training (None when the policy does not report them)."""
    response_length_mean: float
    """Mean fresh response length in tokens."""
    sequences: int
    """Rows trained on (fresh and replayed)."""
    prompts_truncated: int
    generation_rounds: int
    questions_generated: int
    groups_filtered: int
    step_seconds: float
    phase_seconds: dict[str, float]
    """Seconds per phase (rollout, verify, replay, train, weight_push, rollout_wait). With `max_staleness` > 0,
    rollout and verify ran on the background thread, overlapping training; rollout_wait is how long this step
    waited for them."""
    question_ids: list[str]
    """The questions trained on, in batch order."""
    policy_staleness_max: int = 0
    """Most versions between the weights that generated a fresh sample and the weights it trained
    (0 in synchronous steps; at most `algorithm.max_staleness`). Defaults read logs written before it."""
    policy_staleness_mean: float = 0.0
    groups_dropped_stale: int = 0
    """Fresh groups left out because a sample was staler than `algorithm.max_staleness`."""
    rollout_replicas: int = 0
    """Rollout replicas serving at the end of the step (fewer than deployed: some are down or rejoining)."""
    rollout_failovers: int = 0
    """Generation shards retried on another replica since the run started (a replica failed mid-request)."""
    scorer_failures: float = 0.0
    """Fraction of the step's fresh samples the verifier could not score (ERROR or TIMEOUT verdict: reward
    `error_reward`, never a success); above `SCORER_FAILURES_WARN` the step logs a warning."""
    replay_offered: int = 0
    """Groups the replay rule let replay into (`algorithm.replay_rule`: all of them under `always`, with M > 0)."""
    replay_skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    """Groups the rule kept replay out of, by reason (`fresh_succeeded`, `out_of_band`, `retired`)."""
    replay_rescued_groups: int = 0
    """Groups with no fresh success that got a replayed row."""
    replay_traces: int = 0
    """Replayed tool traces trained on as stored (issue 50), among `replay_used`."""
    history_status: str | None = None
    """The step's report to the replay service's per-question history (`ReplayReport.history_status`); absent when
    nothing was reported."""
    history_recorded: int | None = None
    """Questions that report recorded."""
    replay_priorities_updated: int | None = None
    """With `replay_priority: policy_surprise`: stored successes whose priority this step set from the policy's
    logprobs (`ReplayReport.priorities_updated`); absent otherwise."""
    replay_priorities_status: str | None = None
    """`updated`, `no_replayed_rows`, `pool_missing` or `failed: <code>` (with a warning; the step never fails
    for it)."""
    tool_calls_mean: float | None = None
    """With `tools` on: tool calls per fresh episode, every generation round's (absent otherwise)."""
    tool_token_fraction: float | None = None
    """The share of those episodes' response tokens the tool wrote (loss mask 0)."""
    tool_finishes: dict[str, int] | None = None
    """How those episodes ended: `answer`, `length`, `call_limit`, `void` (a call closed, never opened)."""
    tool_void_episodes: int | None = None
    """Those ending in a void turn (a `void` finish, or an `answer` with no answer the verifier could read)."""
    tool_void_turns: str | None = None
    """What the step did with them (`tools.void_turns`): `filter` (out of the loss), `penalize` or `keep`."""
    rollout_mismatch_kl: float | None = None
    """Train/inference mismatch on the fresh tokens (mismatch.py): mean k3 KL(rollout || learner) of the raw
    policies; the `rollout_mismatch_*` fields are None in logs written before them."""
    rollout_mismatch_ratio_p99: float | None = None
    """99th percentile of pi_learner / pi_rollout over the fresh tokens."""
    rollout_mismatch_ratio_max: float | None = None
    rollout_mismatch_outside_cap: float | None = None
    """Fraction of fresh tokens whose ratio leaves [1/behavior_weight_cap, behavior_weight_cap]."""
    rollout_correction_weight_mean: float | None = None
    """With a `behavior_correction`: its mean weight over the fresh tokens (None without one)."""
    rollout_correction_masked: float | None = None
    """Fraction of fresh tokens the correction left out (weight 0: masked_is, seq_masked_is)."""
    rollout_correction_unweighted_rows: int | None = None
    """Rows trained at weight 1 because no sampler drew them (replayed rows)."""
    replay_advantage_share: float | None = None
    """Replayed rows' share of the step's advantage mass, sum of |A| x response tokens (replay_signal.py); the
    `replay_*` figures below are None on a step without replayed rows."""
    replay_signal_groups: int | None = None
    """Groups whose fresh rows all scored alike (no gradient without replay) that replay gave an advantage."""
    replay_logprob_mean: float | None = None
    """Mean per-token logprob of the replayed responses under the policy before the update."""
    replay_sequence_prob_mean: float | None = None
    """Mean chance the policy samples a replayed answer itself, exp(sum of its logprobs)."""
    kl_ref: float | None = None
    """With `algorithm.kl_coef` > 0: the mean per-token KL estimate to the reference policy (`kl_estimator`), under
    the policy being trained (`kl_in: loss`) or the old one (`kl_in: reward`); None without a KL term."""
    eval_accuracy: float | None = None
    """Held-out accuracy after this step; None (and absent from the log) on steps without an evaluation."""
    eval_correct: list[int] | None = None
    """With `eval_accuracy`: correct samples per held-out question, in the evaluation set's order, so accuracy can
    be sliced by difficulty afterwards (issue 49)."""

    def to_json(self) -> dict[str, Any]:
        return _without_none(dataclasses.asdict(self), ABSENT_WHEN_NONE)


# Figures only some steps or runs measure: their keys are absent from a line that has none (not null).
ABSENT_WHEN_NONE = (
    "rollout_mismatch_kl",
    "rollout_mismatch_ratio_p99",
    "rollout_mismatch_ratio_max",
    "rollout_mismatch_outside_cap",
    "rollout_correction_weight_mean",
    "rollout_correction_masked",
    "rollout_correction_unweighted_rows",
    "replay_advantage_share",
    "replay_signal_groups",
    "replay_logprob_mean",
    "replay_sequence_prob_mean",
    "kl_ref",
    "history_status",
    "history_recorded",
    "replay_priorities_updated",
    "replay_priorities_status",
    "tool_calls_mean",
    "tool_token_fraction",
    "tool_finishes",
    "tool_void_episodes",
    "tool_void_turns",
    "eval_accuracy",
    "eval_correct",
)


@dataclass(frozen=True)
class EvalRecord:
    """The evaluation of the weights a run starts from, logged before its first step."""

    step: int
    policy_version: int
    eval_accuracy: float
    eval_correct: list[int] | None = None
    """Correct samples per held-out question (as `StepRecord.eval_correct`); absent from logs written before it."""

    def to_json(self) -> dict[str, Any]:
        return _without_none(dataclasses.asdict(self), ("eval_correct",))


LogRecord = StepRecord | EvalRecord


def _without_none(record: dict[str, Any], absent_when_none: tuple[str, ...]) -> dict[str, Any]:
    """`record` without the keys of `absent_when_none` whose value is None (absent from the line, not null)."""
    return {key: value for key, value in record.items() if value is not None or key not in absent_when_none}


def parse_record(line: dict[str, Any]) -> LogRecord:
    """The record a JSONL line holds (an evaluation-only line has no training figures)."""
    evaluation_only = line.keys() <= {f.name for f in dataclasses.fields(EvalRecord)}
    return EvalRecord(**line) if evaluation_only else StepRecord(**line)


def format_record(record: LogRecord) -> str:
    """One JSONL line (no newline)."""
    return json.dumps(record.to_json())


def read_step_log(path: Path) -> list[LogRecord]:
    """Every record of a JSONL step log, in order."""
    return [parse_record(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
