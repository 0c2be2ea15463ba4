"""The train/inference mismatch figures of a step (services/learner/mismatch.py), against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from rlep.services.learner.mismatch import rollout_mismatch

NAN = float("nan")


def test_figures_match_a_hand_computation_over_the_compared_tokens_only():
    # Row 0: three sampled tokens; row 1: a replayed row (no sampler logprobs) and a padded position.
    old = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-3.0, -3.0, -3.0, -3.0]])
    sampler = torch.tensor([[-1.0, -1.0, -1.5, NAN], [NAN, NAN, NAN, NAN]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    got = rollout_mismatch(old, sampler, mask, cap=2.0)
    log_ratios = [0.0, -1.0, 1.0]  # old - sampler on the three compared tokens
    k3 = [math.exp(x) - 1.0 - x for x in log_ratios]
    assert got.tokens == 3
    assert got.kl == pytest.approx(sum(k3) / 3)
    assert got.ratio_max == pytest.approx(math.e)
    assert got.ratio_p99 == pytest.approx(math.e)  # nearest rank: the 3rd of 3
    # e and 1/e leave [1/2, 2]; ratio 1 does not.
    assert got.outside_cap == pytest.approx(2 / 3)


def test_identical_policies_have_no_mismatch_and_nothing_to_compare_gives_none():
    logprobs = torch.tensor([[-0.7, -1.3]])
    same = rollout_mismatch(logprobs, logprobs.clone(), torch.ones(1, 2), cap=2.0)
    assert (same.kl, same.ratio_max, same.ratio_p99, same.outside_cap) == (0.0, 1.0, 1.0, 0.0)
    assert rollout_mismatch(logprobs, torch.full((1, 2), NAN), torch.ones(1, 2), cap=2.0) is None


def test_a_bfloat16_copy_of_a_policy_shows_a_mismatch_a_float32_copy_does_not():
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    tokens = torch.randint(0, 50, (64, 1))

    def logprobs(dtype):
        return torch.log_softmax(logits.to(dtype).float(), dim=-1).gather(1, tokens).T

    learner = logprobs(torch.float32)
    as_float32 = rollout_mismatch(learner, logprobs(torch.float32), torch.ones(1, 64), cap=2.0)
    as_bfloat16 = rollout_mismatch(learner, logprobs(torch.bfloat16), torch.ones(1, 64), cap=2.0)
    assert as_float32.kl == 0.0 and as_bfloat16.kl > 1e-6


def test_shapes_and_cap_are_checked():
    with pytest.raises(ValueError, match="share a shape"):
        rollout_mismatch(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), cap=2.0)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        rollout_mismatch(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), cap=0.5)


def test_the_config_offers_every_correction():
    from typing import get_args

    from rlep.services.learner.config import AlgorithmConfig
    from rlep.services.learner.mismatch import CORRECTIONS

    assert get_args(AlgorithmConfig.model_fields["behavior_correction"].annotation) == ("auto", "none", *CORRECTIONS)


def test_each_correction_matches_a_hand_computation():
    from rlep.services.learner.mismatch import correction_weights

    # Row 0: log ratios 0, +1, -1 (r = 1, e, 1/e) and a prompt position; row 1: a replayed row (no sampler).
    old = torch.tensor([[-1.0, -1.0, -2.0, -5.0], [-1.0, -1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.0, -2.0, -1.0, NAN], [NAN, NAN, NAN, NAN]])
    e = math.e
    expected = {
        "truncated_is": [[1.0, 2.0, 1 / e, 1.0], [1.0] * 4],  # capped at 2 above, not below
        "seq_truncated_is": [[1.0, 1.0, 1.0, 1.0], [1.0] * 4],  # the product e * 1/e = 1, on every sampled token
        "masked_is": [[1.0, 0.0, 0.0, 1.0], [1.0] * 4],  # e and 1/e leave [1/2, 2]
        "seq_masked_is": [[1.0, 1.0, 1.0, 1.0], [1.0] * 4],  # geometric mean 1: kept
    }
    for mode, weights in expected.items():
        torch.testing.assert_close(correction_weights(mode, old, sampler, cap=2.0), torch.tensor(weights), msg=mode)
    # A sequence whose tokens all lean one way: its product (e^2) is capped, its geometric mean (e) is out.
    leaning = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -2.0]])
    torch.testing.assert_close(correction_weights("seq_truncated_is", *leaning, cap=2.0), torch.full((1, 2), 2.0))
    torch.testing.assert_close(correction_weights("seq_masked_is", *leaning, cap=2.0), torch.zeros(1, 2))
    torch.testing.assert_close(correction_weights("seq_masked_is", *leaning, cap=3.0), torch.ones(1, 2))
    with pytest.raises(ValueError, match="unknown correction"):
        correction_weights("none", old, sampler, cap=2.0)


def test_seq_masked_is_takes_the_geometric_mean_over_the_sampled_tokens_only():
    from rlep.services.learner.mismatch import correction_weights

    # A prompt position and a padding position (no sampler logprob) around two sampled tokens. Log ratios of the
    # sampled tokens: -1 - (-2) = +1 each, sum 2. Geometric mean over the 2 sampled tokens: 2 / 2 = 1 > log 2 (0.69):
    # the sequence leaves [1/2, 2] and its sampled tokens get 0, the unsampled ones keep 1. Averaged over the row's
    # 4 positions instead, it would be 2 / 4 = 0.5 < log 2 and the sequence would wrongly be kept.
    old = torch.tensor([[-5.0, -1.0, -1.0, -5.0]])
    sampler = torch.tensor([[NAN, -2.0, -2.0, NAN]])
    torch.testing.assert_close(
        correction_weights("seq_masked_is", old, sampler, cap=2.0), torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    )
    # And with a wider band (log 3 = 1.10 > 1) the same sequence is kept whole.
    torch.testing.assert_close(correction_weights("seq_masked_is", old, sampler, cap=3.0), torch.ones(1, 4))
