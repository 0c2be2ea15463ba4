"""How much a step's replayed rows could teach (services/learner/replay_signal.py), against a hand computation on
groups normalised by the learner's own advantage function."""

from __future__ import annotations

import math

import pytest
import torch

from rlep.services.learner.algorithm import group_advantages
from rlep.services.learner.replay_signal import replay_signal


def test_a_group_whose_fresh_rows_all_failed_gets_its_only_gradient_from_replay():
    # Group 0: two fresh failures + one replayed success (replay rescues it). Group 1: a fresh success and a
    # failure + one replayed success (it had a gradient already). Group 2: fresh only.
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    group_index = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    replayed = torch.tensor([False, False, True, False, False, True, False, False])
    advantages = group_advantages(rewards, group_index)
    tokens = torch.tensor([2, 2, 3, 1, 1, 4, 2, 2])
    loss_mask = (torch.arange(4)[None, :] < tokens[:, None]).float()
    old_logprobs = torch.full((8, 4), -9.0)  # masked positions must not count
    old_logprobs[2, :3] = torch.tensor([-0.1, -0.2, -0.3])
    old_logprobs[5, :4] = torch.tensor([-0.5, -0.5, -0.5, -0.5])
    got = replay_signal(advantages, rewards, replayed, group_index, old_logprobs, loss_mask)

    mass = advantages.abs() * tokens
    assert got.advantage_share == pytest.approx(float((mass[2] + mass[5]) / mass.sum()))
    assert 0 < got.advantage_share < 1
    assert got.signal_groups == 1
    assert got.logprob_mean == pytest.approx((-0.6 - 2.0) / 7)
    assert got.sequence_prob_mean == pytest.approx((math.exp(-0.6) + math.exp(-2.0)) / 2)


def test_replay_into_groups_its_fresh_rows_already_solved_carries_nothing():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0])
    group_index = torch.tensor([0, 0, 0, 0])
    replayed = torch.tensor([False, False, True, True])
    advantages = group_advantages(rewards, group_index)
    mask = torch.ones(4, 3)
    got = replay_signal(advantages, rewards, replayed, group_index, torch.zeros(4, 3), mask)
    assert (got.advantage_share, got.signal_groups) == (0.0, 0)
    assert got.sequence_prob_mean == 1.0  # logprob 0: the policy samples these answers surely
    assert replay_signal(advantages, rewards, torch.zeros(4, dtype=torch.bool), group_index, mask, mask) is None
