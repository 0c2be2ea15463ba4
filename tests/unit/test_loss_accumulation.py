"""Gradient accumulation as the learner does it: every loss mode, split over micro-batches and processes.

`DeepSpeedPolicy.update` gives each micro-batch `mini_batch_normalizer(whole mini-batch, agg,
world_size)`, sums the micro-batch gradients on each process and lets DeepSpeed average the processes'
gradients; it logs the sum of `loss / world_size` over micro-batches and processes. Here a tiny torch
module stands in for the policy, and both must equal the mini-batch taken in one piece.
"""

from __future__ import annotations

import pytest
import torch

from rlep.services.learner.algorithm import (
    LOSS_AGGREGATIONS,
    LossSettings,
    aggregate_loss,
    mini_batch_normalizer,
    policy_loss,
)

ROWS, LENGTH, FEATURES = 10, 7, 4


class TinyPolicy(torch.nn.Module):
    """Per-token logprobs from per-token features: `[B, T, F]` -> `[B, T]`."""

    def __init__(self):
        super().__init__()
        self.score = torch.nn.Linear(FEATURES, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.logsigmoid(self.score(features).squeeze(-1))


def _mini_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(ROWS, LENGTH, FEATURES, generator=gen)
    old = torch.nn.functional.logsigmoid(torch.randn(ROWS, LENGTH, generator=gen))
    advantages = torch.randn(ROWS, generator=gen)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=gen)
    lengths[3] = 0  # a row with nothing to train: seq-mean must not count it
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).float()
    return features, old, advantages, mask


def _loss(policy, rows, agg, normalizer, batch):
    features, old, advantages, mask = batch
    loss, _ = policy_loss(
        policy(features[rows]), old[rows], advantages[rows], mask[rows], LossSettings(agg=agg), normalizer=normalizer
    )
    return loss


def _full(agg, batch) -> tuple[torch.Tensor, float]:
    policy = _policy()
    loss = _loss(policy, torch.arange(ROWS), agg, None, batch)
    loss.backward()
    return _grad(policy), loss.item()


def _accumulated(agg, batch, micro_splits: list[list[int]], world_size: int = 1) -> tuple[torch.Tensor, float]:
    """Rank r takes rows r::world_size of the mini-batch, cut into `micro_splits[r]` micro-batches."""
    mask = batch[3]
    grads, logged = [], 0.0
    for rank in range(world_size):
        policy = _policy()
        mine = torch.arange(ROWS)[rank::world_size]
        normalizer = mini_batch_normalizer(mask, agg, world_size)
        for rows in torch.split(mine, micro_splits[rank]):
            loss = _loss(policy, rows, agg, normalizer, batch)
            loss.backward()
            logged += loss.item() / world_size
        grads.append(_grad(policy))
    return torch.stack(grads).mean(0), logged  # DeepSpeed averages gradients over processes


def _policy() -> TinyPolicy:
    torch.manual_seed(0)
    return TinyPolicy()


def _grad(policy: TinyPolicy) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in policy.parameters()])


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("splits", [[[10]], [[3, 3, 2, 2]], [[1, 9]], [[2, 3], [1, 4]], [[5], [2, 2, 1]]])
def test_accumulated_gradient_and_logged_loss_equal_the_whole_mini_batch(agg, splits):
    batch = _mini_batch()
    full_grad, full_loss = _full(agg, batch)
    grad, logged = _accumulated(agg, batch, splits, world_size=len(splits))
    torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=1e-5)
    assert logged == pytest.approx(full_loss, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_the_normalizer_is_the_whole_batch_denominator(agg):
    per_token = torch.randn(ROWS, LENGTH)
    mask = _mini_batch()[3]
    normalizer = mini_batch_normalizer(mask, agg)
    torch.testing.assert_close(aggregate_loss(per_token, mask, agg, normalizer), aggregate_loss(per_token, mask, agg))
    expected = mask.sum().item() if agg == "token-mean" else ROWS - 1  # row 3 is empty
    assert normalizer == expected and mini_batch_normalizer(mask, agg, world_size=4) == expected / 4


def test_an_empty_mini_batch_normalizes_by_one_and_bad_modes_are_refused():
    assert all(mini_batch_normalizer(torch.zeros(2, 3), agg) == 1.0 for agg in LOSS_AGGREGATIONS)
    with pytest.raises(ValueError, match="agg"):
        mini_batch_normalizer(torch.ones(2, 3), "mean")
