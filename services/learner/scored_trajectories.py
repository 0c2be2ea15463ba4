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

import math
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
    traces: int = 0
    """Tool traces (issue 50) among the rows prepared for the batch, kept as stored."""
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
            "replay_traces": self.traces,
            "replay_failed_verification": self.failed_verification,
            "replay_dropped": dict(self.dropped),
        }


@dataclass(frozen=True)
class TraceRules:
    """What a stored tool trace must match to be replayed by a run with tools (issue 50). A trace is never
    re-tokenised or cut: its ids continue its prompt's rendering and its mask says which the tool wrote."""

    chat_template_hash: str
    tool_env_hash: str
    run_id: str
    policy_version: int
    """The weights being trained: the staleness of a trace this run wrote is counted from them."""
    max_staleness: int | None = None
    """Traces of this run (online replay) at most this many versions older; other runs' (a phase-1 pool) any."""


def trace_problem(
    t: Trajectory, prompt: EncodedPrompt, tokenizer: PolicyTokenizer, rules: TraceRules | None
) -> str | None:
    """Why stored tool trace `t` cannot be replayed here (a `replay_dropped` reason), or None."""
    if rules is None:
        return "trace_without_tools"  # a run without tools would train on its tool outputs
    env = (t.tokenizer_fingerprint, t.chat_template_hash, t.tool_env_hash)
    if env != (tokenizer.fingerprint, rules.chat_template_hash, rules.tool_env_hash):
        return "trace_env_changed"
    if t.prompt_token_ids and tuple(t.prompt_token_ids) != tuple(prompt.token_ids):
        return "trace_prompt_changed"
    if len(t.response_token_ids) > tokenizer.max_response_tokens:
        return "trace_too_long"  # cut, it would lose its answer and its last turns' calls
    stale = rules.max_staleness is not None and rules.policy_version - t.policy_version > rules.max_staleness
    if t.run_id == rules.run_id and stale:
        return "trace_stale"
    return None


def prepare_replayed(
    sampled: dict[str, list[Trajectory]],
    prompts: dict[str, EncodedPrompt],
    tokenizer: PolicyTokenizer,
    report: ReplayReport,
    traces: TraceRules | None = None,
) -> dict[str, list[Trajectory]]:
    """Replayed successes with this step's prompt ids and policy-tokenizer response ids, unscored. A tool trace is
    kept as stored (ids and mask) where `traces` admits it, and dropped otherwise, never re-tokenised."""
    out: dict[str, list[Trajectory]] = {}
    limit = tokenizer.max_response_tokens
    for qid, found in sampled.items():
        report.received += len(found)
        ready = []
        for t in found:
            if t.response_mask:
                if problem := trace_problem(t, prompts[qid], tokenizer, traces):
                    report.dropped[problem] += 1
                    continue
                ready.append(replace(t, source=Source.REPLAY, prompt_token_ids=prompts[qid].token_ids,
                                     behavior_logprobs=()))  # fmt: skip
                continue
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


def within_token_share(
    replayed: dict[str, list[Trajectory]], fresh_tokens: int, max_fraction: float, report: ReplayReport
) -> dict[str, list[Trajectory]]:
    """The replayed rows that keep replay's share of the step's response tokens (fresh and replayed) at most
    `max_fraction`: each question's first row, then each one's second, ... (a long trace does not crowd out every
    other question's replay); the rest are dropped (`token_budget`). Bounded in tokens, not rows: a multi-turn
    trace can be many times a fresh answer's length."""
    budget = max_fraction / (1 - max_fraction) * fresh_tokens if max_fraction < 1 else math.inf
    kept: dict[str, list[Trajectory]] = {qid: [] for qid in replayed}
    spent = 0
    for rank in range(max((len(rows) for rows in replayed.values()), default=0)):
        for qid, rows in replayed.items():
            if rank >= len(rows):
                continue
            cost = len(rows[rank].response_token_ids)
            if spent + cost > budget:
                report.dropped["token_budget"] += 1
                continue
            spent += cost
            kept[qid].append(rows[rank])
    return {qid: rows for qid, rows in kept.items() if rows}


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
        report.traces += sum(bool(t.response_mask) for t in group)
    return scored
