"""Staleness of overlapped steps (services/learner/overlap.py): measured per sample, enforced per group."""

from __future__ import annotations

import math

import pytest
import torch

from rlep.common.algorithm import policy_loss
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


def test_recomputed_old_logprobs_make_a_stale_batch_start_on_policy():
    """A hand-built case: one token the stale sampler gave probability 0.1 and the learner now gives 0.5, advantage
    +1. With the sampler's logprob as pi_old the ratio is 5, clipped at 1 + 0.28, and the token gets no gradient;
    with pi_old recomputed under the learner's weights the ratio is 1 and the token gets the full policy
    gradient of the learner's current policy, the on-policy update."""
    learner = torch.tensor([[math.log(0.5)]], requires_grad=True)
    sampler = torch.tensor([[math.log(0.1)]])
    advantage, mask = torch.tensor([1.0]), torch.ones(1, 1)

    loss, stats = policy_loss(learner, learner.detach(), advantage, mask)
    (grad,) = torch.autograd.grad(loss, learner)
    assert stats["clip_fraction"] == 0.0 and loss.item() == pytest.approx(-1.0) and grad.item() == pytest.approx(-1.0)

    loss, stats = policy_loss(learner, sampler, advantage, mask)
    (grad,) = torch.autograd.grad(loss, learner)
    assert stats["clip_fraction"] == 1.0 and grad.item() == 0.0
