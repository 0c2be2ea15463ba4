"""`learner.replay_rules`: which groups replay goes into (issue 48 part 2), from the fresh group and the history the
replay service keeps. Pure logic; the learner's use of it runs against a real replay service in
`tests/integration/test_replay_rules_loop.py`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlep.replay.v1 import replay_pb2
from rlep.services.learner.replay_rules import FreshOutcome, ReplayRuleConfig, decide, pass_rate


def fresh(qid: str, successes: int, attempts: int = 8) -> FreshOutcome:
    return FreshOutcome(qid, attempts=attempts, successes=successes, mean_reward=0.0, policy_version=3)


def history(qid: str, attempts: list[int], successes: list[int]) -> replay_pb2.QuestionHistory:
    return replay_pb2.QuestionHistory(question_id=qid, window_attempts=attempts, window_successes=successes)


OUTCOMES = [fresh("none", 0), fresh("one", 1), fresh("half", 4), fresh("all", 8)]


def test_always_offers_every_group_in_order():
    decision = decide(ReplayRuleConfig(), OUTCOMES, {})
    assert decision.offered == ["none", "one", "half", "all"] and not decision.skipped


@pytest.mark.parametrize(("k", "offered"), [(0, ["none"]), (1, ["none", "one"]), (8, ["none", "one", "half", "all"])])
def test_rescue_offers_groups_with_at_most_k_fresh_successes(k, offered):
    decision = decide(ReplayRuleConfig(when="rescue", rescue_max_fresh_successes=k), OUTCOMES, {})
    assert decision.offered == offered
    assert decision.skipped == ({"fresh_succeeded": 4 - len(offered)} if len(offered) < 4 else {})


def test_band_reads_the_window_with_this_steps_group_added():
    """`half` alone is 4/8 = 0.5, in [0.2, 0.5]; its window of 2 visits at 8/8 lifts it to 20/24, out of the band.
    `none` (0/8) is below the band alone, but its window brings it to 6/24 = 0.25, in it."""
    rule = ReplayRuleConfig(when="band", band_low=0.2, band_high=0.5)
    assert decide(rule, OUTCOMES, {}).offered == ["half"]
    histories = {"half": history("half", [8, 8], [8, 8]), "none": history("none", [8, 8], [3, 3])}
    decision = decide(rule, OUTCOMES, histories)
    assert decision.offered == ["none"]
    assert decision.skipped == {"out_of_band": 3}
    assert pass_rate(OUTCOMES[2], histories["half"]) == (20 / 24, 3)


def test_retirement_needs_its_visits_and_beats_any_rule():
    """A question solved 8/8 now and in 3 recorded visits is retired at 4 visits; with 2 recorded it is not yet."""
    rule = ReplayRuleConfig(retire_pass_rate=0.9, retire_min_visits=4)
    mastered = history("all", [8, 8, 8], [8, 8, 7])  # 31/32 with this step
    young = history("all", [8, 8], [8, 8])  # 3 visits with this step
    assert decide(rule, OUTCOMES, {"all": mastered}).skipped == {"retired": 1}
    assert decide(rule, OUTCOMES, {"all": young}).offered == ["none", "one", "half", "all"]
    rescue = ReplayRuleConfig(when="rescue", rescue_max_fresh_successes=8, retire_pass_rate=0.9, retire_min_visits=4)
    assert decide(rescue, OUTCOMES, {"all": mastered}).offered == ["none", "one", "half"]


def test_the_rules_settings_are_checked():
    with pytest.raises(ValidationError, match="band_low"):
        ReplayRuleConfig(when="band", band_low=0.6, band_high=0.4)
    with pytest.raises(ValidationError, match="report_outcomes"):
        ReplayRuleConfig(when="band", report_outcomes=False)
    with pytest.raises(ValidationError, match="report_outcomes"):
        ReplayRuleConfig(retire_pass_rate=0.9, report_outcomes=False)
    assert ReplayRuleConfig(when="rescue", report_outcomes=False).needs_history is False
