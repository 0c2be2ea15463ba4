"""KL to a reference policy and an entropy bonus (issue 33, part 2): off by default and then exactly DAPO's loss;
on, gradients that match a hand computation; the KL reward penalty re-normalises the advantages."""

from __future__ import annotations

import math

import pytest
import torch

from rlep.services.learner.algorithm import LossSettings, group_advantages, kl_estimate, policy_loss
from rlep.services.learner.batch import ExperienceBatch, with_kl_reward_penalty

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # 5 tokens count


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(2, 3, generator=generator)).requires_grad_()
    old = -torch.rand(2, 3, generator=generator)
    ref = -torch.rand(2, 3, generator=generator)
    entropy = torch.rand(2, 3, generator=generator).requires_grad_()
    return logprobs, old, ref, entropy


def test_zero_coefficients_leave_the_loss_and_its_gradient_bit_identical():
    logprobs, old, ref, entropy = inputs()
    advantages = torch.tensor([0.7, -1.2])
    plain, _ = policy_loss(logprobs, old, advantages, MASK)
    (plain_grad,) = torch.autograd.grad(plain, logprobs)
    with_terms, stats = policy_loss(
        logprobs, old, advantages, MASK, LossSettings(kl_coef=0.0, entropy_coef=0.0), ref_logprobs=ref, entropy=entropy
    )
    (terms_grad,) = torch.autograd.grad(with_terms, logprobs)
    assert torch.equal(plain, with_terms) and torch.equal(plain_grad, terms_grad)
    assert "kl_ref" not in stats


@pytest.mark.parametrize(
    ("estimator", "value", "slope"),
    [
        ("k1", lambda d: d, lambda d: 1.0),
        ("k2", lambda d: d * d / 2, lambda d: d),
        ("k3", lambda d: math.exp(-d) - 1 + d, lambda d: 1 - math.exp(-d)),
    ],
)
def test_the_kl_term_and_its_gradient_match_a_hand_computation(estimator, value, slope):
    logprobs, old, ref, _ = inputs(1)
    coef = 0.3
    # Zero advantages: the policy-gradient part is 0 with a zero gradient, what is left is the KL term alone.
    loss, stats = policy_loss(
        logprobs, old, torch.zeros(2), MASK, LossSettings(kl_coef=coef, kl_estimator=estimator), ref_logprobs=ref
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    d = (logprobs - ref).detach()
    counted = [(i, j) for i in range(2) for j in range(3) if MASK[i, j]]
    assert float(loss.detach()) == pytest.approx(coef * sum(value(float(d[i, j])) for i, j in counted) / 5)
    assert float(stats["kl_ref"]) == pytest.approx(sum(value(float(d[i, j])) for i, j in counted) / 5)
    expected = torch.zeros(2, 3)
    for i, j in counted:
        expected[i, j] = coef * slope(float(d[i, j])) / 5
    torch.testing.assert_close(grad, expected)
    assert torch.equal(kl_estimate(ref, ref, estimator), torch.zeros(2, 3))  # no distance from itself


def test_the_entropy_bonus_lowers_the_loss_by_its_coefficient_times_the_mean_entropy():
    logprobs, old, _, entropy = inputs(2)
    loss, _ = policy_loss(logprobs, old, torch.zeros(2), MASK, LossSettings(entropy_coef=0.01), entropy=entropy)
    (grad,) = torch.autograd.grad(loss, entropy)
    assert float(loss.detach()) == pytest.approx(-0.01 * float((entropy * MASK).sum()) / 5)
    torch.testing.assert_close(grad, -0.01 * MASK / 5)


def test_a_term_switched_on_without_its_input_is_refused():
    logprobs, old, _, _ = inputs()
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(logprobs, old, torch.zeros(2), MASK, LossSettings(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs the entropy"):
        policy_loss(logprobs, old, torch.zeros(2), MASK, LossSettings(entropy_coef=0.1))


def test_the_kl_reward_penalty_takes_each_rows_summed_kl_before_normalising():
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.0, -1.0, -9.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    rewards, groups = torch.tensor([1.0, 1.0, -1.0]), torch.tensor([0, 0, 0])
    batch = ExperienceBatch(
        tokens=torch.zeros(3, 4, dtype=torch.long),
        attention_mask=torch.ones(3, 4, dtype=torch.long),
        loss_mask=mask,
        advantages=group_advantages(rewards, groups),
        rewards=rewards,
        replayed=torch.zeros(3, dtype=torch.bool),
        group_index=groups,
        old_logprobs=old,
        ref_logprobs=ref,
    )
    penalized = with_kl_reward_penalty(batch, kl_coef=0.5, estimator="k1")
    # k1 = old - ref over the masked tokens: row 0: 0 + (-1) = -1 (the third token is masked); row 1: 0; row 2: 1.
    expected = torch.tensor([1.0 + 0.5, 1.0, -1.0 - 0.5])
    torch.testing.assert_close(penalized.rewards, expected)
    torch.testing.assert_close(penalized.advantages, group_advantages(expected, groups))
    assert not torch.equal(penalized.advantages, batch.advantages)
