"""Staleness of overlapped steps (services/learner/overlap.py): measured per sample, enforced per group."""

from __future__ import annotations

from rlep.common.dataset import Question
from rlep.common.types import Trajectory
from rlep.services.learner.overlap import Staleness, drop_stale_groups, fresh_staleness
from rlep.services.learner.step_inputs import Gathered


def _groups(versions: list[list[int]]) -> Gathered:
    questions = [Question(f"q{i}", (("user", f"{i}"),), "0") for i in range(len(versions))]
    fresh = [
        [Trajectory(q.question_id, "x", 0.0, policy_version=v) for v in group]
        for q, group in zip(questions, versions, strict=True)
    ]
    return Gathered(questions=questions, prompts=[None] * len(questions), fresh=fresh)


def test_stale_groups_are_dropped_whole_and_staleness_is_measured_per_sample():
    gathered = _groups([[5, 5], [4, 5], [3, 5]])
    assert fresh_staleness(gathered.fresh, trained_version=5) == Staleness(2, 3 / 6)
    assert drop_stale_groups(gathered, trained_version=5, max_staleness=1) == 1
    assert [q.question_id for q in gathered.questions] == ["q0", "q1"] and len(gathered.prompts) == 2
    assert fresh_staleness(gathered.fresh, trained_version=5).max == 1
