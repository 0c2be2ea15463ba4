"""Algorithm core: hand-computed values, verl reference, micro-batch invariance, mixed-group baselines, lr warm-up."""

import math

import pytest
import torch

from rlep.common.types import Group, Source, Trajectory
from rlep.services.learner.algorithm import (
    LossSettings,
    NonFiniteError,
    flatten_groups,
    group_advantages,
    overlong_penalty,
    policy_loss,
    warmup_lr,
)


def verl_grpo_reference(rewards: torch.Tensor, group_ids: list[int], eps: float = 1e-6) -> torch.Tensor:
    """verl's compute_grpo_outcome_advantage, written as its per-sample loop (test oracle)."""
    by_group: dict[int, list[torch.Tensor]] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        by_group.setdefault(g, []).append(r)
    stats = {}
    for g, values in by_group.items():
        if len(values) == 1:
            stats[g] = (torch.tensor(0.0), torch.tensor(1.0))
        else:
            stacked = torch.stack(values)
            stats[g] = (stacked.mean(), stacked.std())
    return torch.stack([(r - stats[g][0]) / (stats[g][1] + eps) for r, g in zip(rewards, group_ids, strict=True)])


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 5.0])
    group_ids = torch.tensor([0, 0, 0, 0, 7, 7, 3])
    adv = group_advantages(rewards, group_ids)
    z = 0.5 / math.sqrt(1 / 3)  # |r - 0.5| / unbiased std of {1, 0, 0, 1}
    expected = torch.tensor([z, -z, -z, z, 0.0, 0.0, 5.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_group_advantages_match_verl_loop_on_random_groups():
    gen = torch.Generator().manual_seed(0)
    group_ids = torch.randint(0, 20, (300,), generator=gen)
    rewards = torch.randn(300, generator=gen)
    expected = verl_grpo_reference(rewards, group_ids.tolist())
    torch.testing.assert_close(group_advantages(rewards, group_ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [0.0, 1.0, -1.0])
def test_degenerate_groups_have_zero_advantage(value):
    rewards = torch.full((18,), value)
    group_ids = torch.tensor([0] * 9 + [1] * 9)
    assert torch.equal(group_advantages(rewards, group_ids), torch.zeros(18))


def test_replayed_and_fresh_share_one_baseline():
    """All fresh samples wrong: alone they carry no signal; with replayed successes they are pushed down."""
    fresh = [Trajectory("q1", f"wrong {i}", reward=0.0, source=Source.FRESH) for i in range(4)]
    replayed = [Trajectory("q1", f"right {i}", reward=1.0, source=Source.REPLAY) for i in range(2)]
    _, rewards, group_ids = flatten_groups([Group("q1", "3", fresh + replayed)])
    adv = group_advantages(rewards, group_ids)
    mean, std = 2 / 6, torch.tensor([0.0] * 4 + [1.0] * 2).std().item()
    torch.testing.assert_close(adv[:4], torch.full((4,), (0 - mean) / (std + 1e-6)))
    torch.testing.assert_close(adv[4:], torch.full((2,), (1 - mean) / (std + 1e-6)))
    _, fresh_rewards, fresh_ids = flatten_groups([Group("q1", "3", fresh)])
    assert torch.equal(group_advantages(fresh_rewards, fresh_ids), torch.zeros(4))


def test_group_advantages_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_group_advantages_refuse_non_finite_rewards(bad):
    """One NaN or infinite reward would turn its whole group's advantages into NaN: refused, naming the index."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, bad, 1.0])
    message = rf"index 4 \(group id 9\), is {bad}: every reward must be a finite number"
    with pytest.raises(NonFiniteError, match=message) as err:
        group_advantages(rewards, torch.tensor([3, 3, 3, 9, 9, 9]))
    assert err.value.index == 4


def test_group_advantages_of_huge_finite_rewards_stay_finite_and_exact():
    """Squares of rewards near float32's limit overflow in float32; the statistics run in float64."""
    adv = group_advantages(torch.tensor([3e38, -3e38, 0.0]), torch.tensor([0, 0, 0]))
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0]), atol=1e-5, rtol=1e-5)


def _loss_inputs():
    # ratios: seq 0 (A=+1) -> [1.5, 0.5]; seq 1 (A=-1) -> [20, 1.0]
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.5, 0.5], [20.0, 1.0]])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return new, old, adv, mask


def test_policy_loss_hand_computed_token_mean_and_gradients():
    new, old, adv, mask = _loss_inputs()
    loss, metrics = policy_loss(new, old, adv, mask)
    # Statistics stay on the loss's device as 0-dim tensors (no host sync per micro-batch).
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad for v in metrics.values())
    # per token: (0,0) clip-high active -> -1.28; (0,1) unclipped -> -0.5; (1,0) dual-clip -> 10; (1,1) masked
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 10.0) / 3, abs=1e-5)
    loss.backward()
    # gradient flows only through the unclipped token: d(-A * r)/d logprob = -A * r, over 3 tokens
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.5 / 3], [0.0, 0.0]]))
    assert float(metrics["clip_fraction"]) == pytest.approx(1 / 3, abs=1e-6)
    assert float(metrics["clip_fraction_dual"]) == pytest.approx(1 / 3, abs=1e-6)
    assert float(metrics["approx_kl"]) == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(20)) / 3, abs=1e-5)


@pytest.mark.parametrize(
    ("agg", "expected"),
    [("seq-mean-token-mean", ((-1.28 - 0.5) / 2 + 10.0) / 2), ("seq-mean-token-sum", ((-1.28 - 0.5) + 10.0) / 2)],
)
def test_policy_loss_sequence_aggregations(agg, expected):
    new, old, adv, mask = _loss_inputs()
    loss, _ = policy_loss(new, old, adv, mask, LossSettings(agg=agg))
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_policy_loss_ratio_is_clamped_like_verl():
    loss, metrics = policy_loss(torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.tensor([1.0]), torch.ones(1, 1))
    assert math.isfinite(loss.item()) and float(metrics["ratio_mean"]) == pytest.approx(math.exp(20.0), rel=1e-4)


def test_policy_loss_empty_mask_is_zero_with_zero_gradient():
    new = torch.randn(3, 5, requires_grad=True)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss, metrics = policy_loss(new, torch.zeros(3, 5), torch.ones(3), torch.zeros(3, 5), LossSettings(agg=agg))
        loss.backward()
        assert loss.item() == 0.0 and torch.count_nonzero(new.grad) == 0
        assert all(math.isfinite(v) for v in metrics.values())
        new.grad = None


def test_policy_loss_rejects_bad_shapes_and_agg():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="agg"):
        LossSettings(agg="mean")
    with pytest.raises(ValueError, match="clip_c"):
        LossSettings(clip_c=1.0)


def _random_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch, length = 12, 16
    logits = torch.randn(batch, length, generator=gen) * 0.3
    old = torch.randn(batch, length, generator=gen) * 0.3
    adv = torch.randn(batch, generator=gen)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return logits, old, adv, mask


@pytest.mark.parametrize("split", [[12], [6, 6], [1, 5, 2, 4], [3, 3, 3, 3]])
def test_token_mean_gradient_is_invariant_to_micro_batching(split):
    logits, old, adv, mask = _random_batch(1)
    full = logits.clone().requires_grad_(True)
    policy_loss(full, old, adv, mask)[0].backward()

    accumulated = logits.clone().requires_grad_(True)
    total_tokens = mask.sum().item()
    start = 0
    for size in split:
        rows = slice(start, start + size)
        loss, _ = policy_loss(accumulated[rows], old[rows], adv[rows], mask[rows], normalizer=total_tokens)
        loss.backward()
        start += size
    torch.testing.assert_close(accumulated.grad, full.grad, atol=1e-6, rtol=1e-5)


def test_averaging_micro_batch_token_means_would_not_be_invariant():
    """Guards the test above: the naive per-micro-batch mean really gives a different gradient."""
    logits, old, adv, mask = _random_batch(1)
    full = logits.clone().requires_grad_(True)
    policy_loss(full, old, adv, mask)[0].backward()
    naive = logits.clone().requires_grad_(True)
    for rows in (slice(0, 1), slice(1, 12)):
        (policy_loss(naive[rows], old[rows], adv[rows], mask[rows])[0] / 2).backward()
    assert not torch.allclose(naive.grad, full.grad, atol=1e-4)


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty = overlong_penalty(lengths, max_len=20, buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = overlong_penalty(lengths, max_len=20, buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))


def test_overlong_penalty_without_buffer_is_a_step_and_checks_args():
    torch.testing.assert_close(overlong_penalty(torch.tensor([19, 20, 21]), 20, 0, 1.0), torch.tensor([0.0, 0.0, -1.0]))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=8, penalty_factor=1.0)


def test_warmup_lr_is_linear_in_training_steps_and_never_zero():
    assert [warmup_lr(k, 1.0, warmup_steps=4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_lr(0, 3e-6, warmup_steps=1) == 3e-6
    assert warmup_lr(0, 3e-6, warmup_steps=0) == 3e-6  # no warm-up: the full lr from the first step
