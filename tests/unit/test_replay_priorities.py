"""`replay_priority: policy_surprise` (issue 48): priorities from the policy's old logprobs, and the config that
refuses it where it would change nothing."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from rlep.common.types import Source, Trajectory
from rlep.services.learner.config import AlgorithmConfig
from rlep.services.learner.replay_priorities import policy_surprise, priority_updates


def test_surprise_is_one_minus_the_per_token_chance_over_response_tokens_only():
    """Prompt and padding positions (mask 0) carry logprobs the mean must not see: row 0's two response tokens of
    logprob ln 0.5 give 1 - 0.5; dividing by the row's length instead would give 1 - 0.5^(1/2). A certain answer is
    raised to the floor, a row without response tokens gets 1."""
    half = math.log(0.5)
    old = torch.tensor([[-5.0, half, half, -7.0], [math.log(0.99)] * 4, [-3.0, -3.0, -3.0, -3.0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    assert policy_surprise(old, mask, floor=0.05).tolist() == pytest.approx([0.5, 0.05, 1.0])
    unlikely = torch.tensor([[math.log(0.1)] * 3])
    assert policy_surprise(unlikely, torch.ones(1, 3), floor=0.05).tolist() == pytest.approx([0.9])


def test_updates_name_the_replayed_rows_stored_successes_in_batch_order():
    rows = [
        Trajectory("q1", "fresh answer", 0.0),
        Trajectory("q1", "stored \\boxed{1}", 1.0, Source.REPLAY),
        Trajectory("q2", "stored \\boxed{2}", 1.0, Source.REPLAY),
    ]
    updates = priority_updates(rows, torch.tensor([False, True, True]), torch.tensor([0.9, 0.25, 0.5]))
    assert updates == [("q1", rows[1].id, 0.25), ("q2", rows[2].id, 0.5)]


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        ({"replay_strategy": "prioritized"}, False),
        ({"replay_strategy": "uniform"}, True),  # priorities change no uniform draw
        ({"replay_strategy": "prioritized", "replayed_per_question": 0}, True),  # no replay, nothing to prioritise
    ],
)
def test_policy_surprise_is_refused_where_it_would_change_nothing(settings, refused):
    settings = {"replay_priority": "policy_surprise", **settings}
    if refused:
        with pytest.raises(ValidationError, match="changes nothing"):
            AlgorithmConfig.model_validate(settings)
    else:
        assert AlgorithmConfig.model_validate(settings).replay_priority == "policy_surprise"
