"""The learner's Prometheus series (`rlep_learner_*`): one gauge per logged training figure.

The same figures go to the JSONL log each step; `STEP_GAUGES` maps a field of the step's record
(records.py, whose field names are the log's keys) to its series so the two never drift apart.

A field that only some records carry (`UNTIL_FIRST_VALUE`: `eval_accuracy`, only with `eval.every_steps`) has no
series until a record gives it a value, as its key is absent from the log: a gauge without a value would be
scraped as 0.0, an accuracy nobody measured.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from rlep.services.learner.records import LogRecord, StepRecord

# record field -> (metric name, help); a field a record lacks or leaves None keeps its gauge as it was
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "step": ("rlep_learner_step", "Training steps completed"),
    "policy_version": ("rlep_learner_policy_version", "Weight version last pushed to rollout"),
    "reward_mean": ("rlep_learner_reward_mean", "Mean reward of the step's fresh samples (shaping included)"),
    "fresh_accuracy": ("rlep_learner_fresh_accuracy", "Fraction of the step's fresh samples verified correct"),
    "replayed_fraction": ("rlep_learner_replayed_fraction", "Replayed responses / all responses trained on"),
    "replay_requested": ("rlep_learner_replay_requested", "Replayed answers asked for in the last step (B x M)"),
    "replay_used": ("rlep_learner_replay_used", "Replayed answers trained on in the last step"),
    "replay_retokenized": (
        "rlep_learner_replay_retokenized",
        "Replayed answers of the last step re-tokenised with the policy's tokenizer (text only or another tokenizer)",
    ),
    "replay_failed_verification": (
        "rlep_learner_replay_failed_verification",
        "Replayed answers of the last step that this run's verifier did not find correct",
    ),
    "replay_offered": (
        "rlep_learner_replay_offered",
        "Groups of the last step the replay rule let replay into (algorithm.replay_rule; all under `always`)",
    ),
    "replay_rescued_groups": (
        "rlep_learner_replay_rescued_groups",
        "Groups of the last step with no fresh success that got a replayed row",
    ),
    "replay_advantage_share": (
        "rlep_learner_replay_advantage_share",
        "Replayed rows' share of the last step's advantage mass (|A| x response tokens)",
    ),
    "replay_signal_groups": (
        "rlep_learner_replay_signal_groups",
        "Groups of the last step with no gradient from their fresh rows that replay gave one",
    ),
    "replay_sequence_prob_mean": (
        "rlep_learner_replay_sequence_prob_mean",
        "Mean chance the policy samples a replayed answer of the last step itself",
    ),
    "prompts_truncated": ("rlep_learner_prompts_truncated", "Prompts left-truncated to max_prompt_tokens last step"),
    "generation_rounds": ("rlep_learner_generation_rounds", "Generation rounds of the last step (dynamic sampling)"),
    "groups_filtered": (
        "rlep_learner_groups_filtered",
        "Groups dropped by dynamic sampling last step (all rewards equal)",
    ),
    "policy_staleness_max": (
        "rlep_learner_policy_staleness",
        "Most weight versions between a fresh sample's generation and its update last step (0 = on-policy)",
    ),
    "groups_dropped_stale": (
        "rlep_learner_groups_dropped_stale",
        "Fresh groups dropped last step for being staler than algorithm.max_staleness",
    ),
    "rollout_replicas": ("rlep_learner_rollout_replicas", "Rollout replicas serving at the end of the last step"),
    "scorer_failures": (
        "rlep_learner_scorer_failures",
        "Fraction of the last step's fresh samples the verifier could not score (ERROR or TIMEOUT)",
    ),
    "rollout_failovers": (
        "rlep_learner_rollout_failovers",
        "Generation shards retried on another replica since the run started (a replica failed mid-request)",
    ),
    "advantage_mean": ("rlep_learner_advantage_mean", "Mean advantage over the step's responses"),
    "advantage_std": ("rlep_learner_advantage_std", "Std of the advantages over the step's responses"),
    "clip_fraction": ("rlep_learner_clip_fraction", "Fraction of tokens whose ratio was clipped"),
    "approx_kl": ("rlep_learner_approx_kl", "Approximate KL(old || new) over the step's tokens"),
    "entropy": ("rlep_learner_entropy", "Mean per-token entropy of the policy on the step's responses"),
    "response_length_mean": ("rlep_learner_response_length_mean", "Mean response length in tokens"),
    "rollout_mismatch_kl": ("rlep_learner_rollout_mismatch_kl", "Mean k3 KL(rollout || learner) on fresh tokens"),
    "rollout_mismatch_ratio_p99": ("rlep_learner_rollout_mismatch_ratio_p99", "p99 of pi_learner / pi_rollout"),
    "rollout_mismatch_ratio_max": ("rlep_learner_rollout_mismatch_ratio_max", "Largest pi_learner / pi_rollout"),
    "rollout_mismatch_outside_cap": (
        "rlep_learner_rollout_mismatch_outside_cap",
        "Fraction of fresh tokens whose pi_learner / pi_rollout leaves [1/cap, cap]",
    ),
    "kl_ref": ("rlep_learner_kl_ref", "Mean KL estimate to the reference policy (with a KL term)"),
    "eval_accuracy": ("rlep_learner_eval_accuracy", "Accuracy on the held-out evaluation set (last evaluation)"),
}
# Fields whose gauge is registered (and so scraped) only once a record gives it a value.
UNTIL_FIRST_VALUE = frozenset({"eval_accuracy", "kl_ref"})
PHASES = ("rollout", "verify", "replay", "train", "weight_push", "rollout_wait")


class LearnerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self._registry = registry
        self.gauges = {
            key: Gauge(name, text, registry=None if key in UNTIL_FIRST_VALUE else registry)
            for key, (name, text) in STEP_GAUGES.items()
        }
        self._unregistered = set(UNTIL_FIRST_VALUE)
        self.step_seconds = Gauge(
            "rlep_learner_step_seconds", "Seconds the last step spent in each phase", ["phase"], registry=registry
        )
        self.phase_seconds = Counter(
            "rlep_learner_phase_seconds_total", "Seconds spent in each phase since start", ["phase"], registry=registry
        )
        for phase in PHASES:
            self.step_seconds.labels(phase)
            self.phase_seconds.labels(phase)

    def record(self, record: LogRecord) -> None:
        for field, gauge in self.gauges.items():
            value = getattr(record, field, None)
            if value is not None:
                gauge.set(value)
                if field in self._unregistered:
                    self._registry.register(gauge)
                    self._unregistered.discard(field)
        phase_seconds = record.phase_seconds if isinstance(record, StepRecord) else {}
        for phase, seconds in phase_seconds.items():
            self.step_seconds.labels(phase).set(seconds)
            self.phase_seconds.labels(phase).inc(seconds)
