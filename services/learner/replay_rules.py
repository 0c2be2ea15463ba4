"""Whether a question's group gets replayed answers this step, from its fresh group and the history the replay
service keeps of it (issue 48; docs/replay.md, *Replay rules*).

The rules (`algorithm.replay_rule`), beside the replay strategies that choose *which* successes:
- `always`: every question (RLEP's paper; the default, and the step is then exactly what it was before rules).
- `rescue`: only groups with at most `rescue_max_fresh_successes` fresh successes (AR3PO, arXiv 2509.25808: replay
  only where the fresh group has no success, so replay supplies the signal the group lacks).
- `band`: only questions whose pass rate lies in [`band_low`, `band_high`] (ExGRPO, arXiv 2510.02245, partitions by
  it): the recent window's successes and attempts kept by the replay service, this step's fresh group added.
- retirement, beside any of them (`retire_pass_rate`): a question whose pass rate (as for `band`) is at least that
  over at least `retire_min_visits` visits (this one included) gets no replay: the policy has mastered it, and
  replay there spends rows and compute on answers the policy samples itself (docs/results.md: late in the
  miniature, rescues fell to 0.05 per step). The data cursor still visits it: its fresh group is trained as before
  and its history keeps telling whether it stays mastered.

Pure logic: `decide` takes the fresh outcomes and the histories (`replay_pb2.QuestionHistory` or anything with
`window_attempts` / `window_successes`) and says which questions are offered and why the others are not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import Field, model_validator

from rlep.common.config import StrictModel
from rlep.common.types import Trajectory, Verdict

SkipReason = Literal["fresh_succeeded", "out_of_band", "retired"]


class ReplayRuleConfig(StrictModel):
    when: Literal["always", "rescue", "band"] = "always"
    """Which groups replay goes into: every one (`always`, the paper), those with at most
    `rescue_max_fresh_successes` fresh successes (`rescue`), or questions whose pass rate lies in the band."""
    rescue_max_fresh_successes: int = Field(0, ge=0)
    band_low: float = Field(0.0, ge=0, le=1)
    band_high: float = Field(0.5, ge=0, le=1)
    retire_pass_rate: float | None = Field(None, gt=0, le=1)
    """None = no retirement. Else a question at or above this pass rate over `retire_min_visits` visits gets no
    replay, whatever `when` says."""
    retire_min_visits: int = Field(4, ge=1)
    report_outcomes: bool = True
    """With replay on (M > 0 or `online_replay`), report every step's fresh outcome per question to the replay
    service's history of the pool; `band` and retirement need it. A baseline (M = 0) reports nothing: the pool
    it would be told about does not exist yet."""

    @model_validator(mode="after")
    def check(self) -> ReplayRuleConfig:
        if self.band_low > self.band_high:
            raise ValueError(f"replay_rule: band_low ({self.band_low}) is above band_high ({self.band_high})")
        if self.needs_history and not self.report_outcomes:
            raise ValueError("replay_rule: `band` and retirement read the history that report_outcomes keeps")
        return self

    @property
    def needs_history(self) -> bool:
        return self.when == "band" or self.retire_pass_rate is not None


class History(Protocol):
    window_attempts: Sequence[int]
    window_successes: Sequence[int]


@dataclass(frozen=True)
class FreshOutcome:
    """One question's fresh group in one step, as the replay service's history records it."""

    question_id: str
    attempts: int
    successes: int
    mean_reward: float
    policy_version: int

    @classmethod
    def of(cls, question_id: str, group: Sequence[Trajectory]) -> FreshOutcome:
        return cls(
            question_id,
            attempts=len(group),
            successes=sum(t.verdict == Verdict.CORRECT for t in group),
            mean_reward=sum(t.reward for t in group) / len(group) if group else 0.0,
            policy_version=max((t.policy_version for t in group), default=0),
        )


@dataclass
class Decision:
    offered: list[str] = field(default_factory=list)
    """Questions replay is asked for, in the step's order."""
    skipped: Counter = field(default_factory=Counter)
    """Reason -> questions not offered."""


def pass_rate(outcome: FreshOutcome, history: History | None) -> tuple[float, int]:
    """(pass rate, visits): the history's recent window with this step's fresh group added."""
    attempts, successes, visits = outcome.attempts, outcome.successes, 1
    if history is not None:
        attempts += sum(history.window_attempts)
        successes += sum(history.window_successes)
        visits += len(history.window_attempts)
    return successes / attempts, visits


def decide(rule: ReplayRuleConfig, outcomes: Sequence[FreshOutcome], histories: Mapping[str, History]) -> Decision:
    decision = Decision()
    for outcome in outcomes:
        reason = _skip_reason(rule, outcome, histories.get(outcome.question_id))
        if reason is None:
            decision.offered.append(outcome.question_id)
        else:
            decision.skipped[reason] += 1
    return decision


def _skip_reason(rule: ReplayRuleConfig, outcome: FreshOutcome, history: History | None) -> SkipReason | None:
    rate, visits = pass_rate(outcome, history)
    if rule.retire_pass_rate is not None and visits >= rule.retire_min_visits and rate >= rule.retire_pass_rate:
        return "retired"
    if rule.when == "rescue" and outcome.successes > rule.rescue_max_fresh_successes:
        return "fresh_succeeded"
    if rule.when == "band" and not rule.band_low <= rate <= rule.band_high:
        return "out_of_band"
    return None
