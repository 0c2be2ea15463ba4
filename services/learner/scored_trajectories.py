"""Turning rollout output and replay samples into scored trajectories of one step (pure: no services).

- `sampled_trajectories`: a question's rollout samples with their verifier outcomes, as trajectories
  (fresh ones for training, verified successes for `collect`).
- `score_fresh`: those of a training step, with DAPO's overlong shaping.
- `prepare_replayed`: replayed successes laid out like fresh samples of this step's prompt (see
  `tokens.py`), counted in a `ReplayReport` so a step that silently got no replay cannot happen.
- `group_varies`: DAPO's dynamic-sampling filter (a group whose rewards are all equal has zero
  advantage everywhere and teaches nothing).

Fresh and replayed answers get the same reward rule: verifier reward (replayed ones re-verified unless
`reverify_replayed` is off) plus the overlong penalty of their (cut) length, as the reference's reward
manager does for the whole batch.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from rlep.common.types import FinishReason, Source, Trajectory, Verdict
from rlep.services.learner.algorithm import overlong_penalty
from rlep.services.learner.config import AlgorithmConfig
from rlep.services.learner.tokens import EncodedPrompt, PolicyTokenizer
from rlep.services.rollout.types import Completion, SampleOut


def shaped_reward(reward: float, response_tokens: int, algo: AlgorithmConfig) -> float:
    """Task reward plus DAPO's soft overlong penalty for a response of `response_tokens` tokens."""
    if algo.overlong_buffer_tokens == 0:
        return reward
    penalty = overlong_penalty(
        torch.tensor([response_tokens]), algo.max_response_tokens, algo.overlong_buffer_tokens, algo.overlong_penalty
    )
    return reward + float(penalty[0])


def sampled_trajectories(
    question_id: str,
    prompt_token_ids: Sequence[int],
    samples: Sequence[SampleOut],
    outcomes: Sequence,
    source: Source,
    run_id: str,
    fingerprint: str,
    reward: Callable[[float, SampleOut], float] = lambda verified, sample: verified,
) -> list[Trajectory]:
    """One trajectory per rollout sample of a question, with its verifier outcome (one per sample, in order).

    `reward(verifier reward, sample)` gives the stored reward (default: the verifier's as it is).
    """
    now_ms = int(time.time() * 1000)
    return [
        Trajectory(
            question_id=question_id,
            response_text=s.text,
            reward=reward(outcome.reward, s),
            source=source,
            verdict=outcome.verdict,
            policy_version=s.policy_version,
            finish_reason=s.finish_reason,
            prompt_token_ids=tuple(prompt_token_ids),
            response_token_ids=tuple(s.token_ids),
            behavior_logprobs=tuple(s.logprobs),
            run_id=run_id,
            created_at_ms=now_ms,
            tokenizer_fingerprint=fingerprint,
        )
        for s, outcome in zip(samples, outcomes, strict=True)
    ]


def score_fresh(
    question_id: str,
    prompt: EncodedPrompt,
    completion: Completion,
    outcomes: Sequence,
    algo: AlgorithmConfig,
    run_id: str,
    fingerprint: str,
) -> list[Trajectory]:
    """One question's fresh trajectories, rewards shaped for overlong responses."""
    return sampled_trajectories(
        question_id,
        prompt.token_ids,
        completion.samples,
        outcomes,
        Source.FRESH,
        run_id,
        fingerprint,
        reward=lambda verified, sample: shaped_reward(verified, len(sample.token_ids), algo),
    )


def group_varies(group: Sequence[Trajectory], metric: str) -> bool:
    """DAPO's keep rule: the group's `acc` (verified correct) or `score` (shaped reward) is not constant."""
    values = {t.verdict == Verdict.CORRECT for t in group} if metric == "acc" else {t.reward for t in group}
    return len(values) > 1


@dataclass
class ReplayReport:
    """What replay contributed to one step. `requested - received` went missing in the pool."""

    requested: int = 0
    received: int = 0
    used: int = 0
    retokenized: int = 0
    """Answers whose ids were missing or came from another tokenizer, re-tokenised with the policy's."""
    truncated: int = 0
    failed_verification: int = 0
    """Used, but this run's verifier did not find them correct (trained with the reward it gave)."""
    dropped: Counter = field(default_factory=Counter)
    """Reason -> answers (or missing answers) that did not reach the batch."""
    offered: int = 0
    """Groups the replay rule let replay into (`learner.replay_rules`; all of them under `always`)."""
    skipped: Counter = field(default_factory=Counter)
    """Reason -> groups the rule kept replay out of."""
    rescued_groups: int = 0
    """Groups with no fresh success that got at least one replayed row."""
    history_status: str | None = None
    """What reporting the step's outcomes to the replay service's history did: `recorded`, `duplicate` (a resumed
    run's step already reported), `pool_missing`, `failed: <code>`; None when nothing was reported (no replay
    service, or `replay_rule.report_outcomes` off)."""
    history_recorded: int | None = None
    """Questions the report recorded."""
    priorities_updated: int | None = None
    """With `replay_priority: policy_surprise`: stored successes whose priority the step set (None: not on, or no
    replayed row)."""
    priorities_status: str | None = None
    """What setting them did: `updated`, `no_replayed_rows`, `pool_missing`, `failed: <code>`; None when off."""

    def record(self) -> dict:
        return {
            "replay_offered": self.offered,
            "replay_skipped": dict(self.skipped),
            "replay_rescued_groups": self.rescued_groups,
            "history_status": self.history_status,
            "history_recorded": self.history_recorded,
            "replay_priorities_updated": self.priorities_updated,
            "replay_priorities_status": self.priorities_status,
            "replay_requested": self.requested,
            "replay_received": self.received,
            "replay_used": self.used,
            "replay_retokenized": self.retokenized,
            "replay_truncated": self.truncated,
            "replay_failed_verification": self.failed_verification,
            "replay_dropped": dict(self.dropped),
        }


def prepare_replayed(
    sampled: dict[str, list[Trajectory]],
    prompts: dict[str, EncodedPrompt],
    tokenizer: PolicyTokenizer,
    report: ReplayReport,
) -> dict[str, list[Trajectory]]:
    """Replayed successes with this step's prompt ids and policy-tokenizer response ids, unscored."""
    out: dict[str, list[Trajectory]] = {}
    limit = tokenizer.max_response_tokens
    for qid, found in sampled.items():
        report.received += len(found)
        ready = []
        for t in found:
            if t.tokenizer_fingerprint == tokenizer.fingerprint and t.response_token_ids:
                ids, truncated = t.response_token_ids[:limit], len(t.response_token_ids) > limit
            elif t.response_text.strip():
                encoded = tokenizer.encode_response(t.response_text)
                ids, truncated = encoded.token_ids, encoded.truncated
                report.retokenized += 1
            else:
                report.dropped["empty_answer"] += 1
                continue
            report.truncated += truncated
            ready.append(
                replace(
                    t,
                    source=Source.REPLAY,
                    prompt_token_ids=prompts[qid].token_ids,
                    response_token_ids=tuple(ids),
                    behavior_logprobs=(),  # sampled for another prompt or cut: old logprobs are recomputed anyway
                    finish_reason=FinishReason.LENGTH if truncated else t.finish_reason,
                    tokenizer_fingerprint=tokenizer.fingerprint,
                )
            )
        if ready:
            out[qid] = ready
    return out


def score_replayed(
    replayed: dict[str, list[Trajectory]],
    outcomes: dict[str, Sequence] | None,
    algo: AlgorithmConfig,
    report: ReplayReport,
) -> dict[str, list[Trajectory]]:
    """Rewards of replayed answers: this run's verifier outcome (or the stored reward) plus overlong shaping."""
    scored: dict[str, list[Trajectory]] = {}
    for qid, group in replayed.items():
        results = outcomes[qid] if outcomes is not None else [None] * len(group)
        scored[qid] = []
        for t, outcome in zip(group, results, strict=True):
            base, verdict = (t.reward, t.verdict) if outcome is None else (outcome.reward, outcome.verdict)
            report.failed_verification += verdict != Verdict.CORRECT
            reward = shaped_reward(base, len(t.response_token_ids), algo)
            scored[qid].append(replace(t, reward=reward, verdict=verdict))
        report.used += len(group)
    return scored
