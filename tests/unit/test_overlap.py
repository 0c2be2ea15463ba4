"""Staleness of overlapped steps (services/learner/overlap.py): measured per sample, enforced per group."""

from __future__ import annotations

import math

import pytest
import torch

from rlep.common.dataset import Question
from rlep.common.types import Trajectory
from rlep.services.learner.algorithm import policy_loss
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
    assert float(stats["clip_fraction"]) == 0.0
    assert loss.item() == pytest.approx(-1.0) and grad.item() == pytest.approx(-1.0)

    loss, stats = policy_loss(learner, sampler, advantage, mask)
    (grad,) = torch.autograd.grad(loss, learner)
    assert float(stats["clip_fraction"]) == 1.0 and grad.item() == 0.0


def test_truncated_is_weights_a_stale_token_by_its_ratio_to_the_sampler():
    """The same token with `truncated_is`: pi_old / pi_sampler = 0.5 / 0.1 = 5, truncated at the cap 2, scales the
    on-policy gradient; a token the sampler over-weighted (0.5 vs 0.8 now) is down-weighted by 0.625; a token with
    no sampler logprob (a replayed row, NaN) keeps weight 1."""
    from rlep.services.learner.mismatch import correction_weights

    learner = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.5)]], requires_grad=True)
    sampler = torch.tensor([[math.log(0.1), math.log(0.8), float("nan")]])
    weights = correction_weights("truncated_is", learner.detach(), sampler, cap=2.0)
    assert weights.tolist()[0] == pytest.approx([2.0, 0.625, 1.0])
    assert not weights.requires_grad

    advantage, mask = torch.tensor([1.0]), torch.ones(1, 3)
    loss, _ = policy_loss(learner, learner.detach(), advantage, mask, token_weights=weights)
    (grad,) = torch.autograd.grad(loss, learner)
    # token-mean over 3 tokens of -A * w * ratio: d/dlogp = -w / 3 at ratio 1.
    assert grad.tolist()[0] == pytest.approx([-2.0 / 3, -0.625 / 3, -1.0 / 3])


def test_correction_weights_refuse_a_cap_below_one_and_mismatched_shapes():
    from rlep.services.learner.mismatch import correction_weights

    with pytest.raises(ValueError, match="cap"):
        correction_weights("truncated_is", torch.zeros(1, 2), torch.zeros(1, 2), cap=0.5)
    with pytest.raises(ValueError, match="shape"):
        correction_weights("truncated_is", torch.zeros(1, 2), torch.zeros(1, 3), cap=2.0)


def test_the_batch_carries_sampler_logprobs_of_fresh_rows_only_in_the_loss_layout():
    from rlep.common.types import Group, Source
    from rlep.services.learner.batch import build_batch

    fresh = Trajectory(
        "q", "a", 1.0, prompt_token_ids=(1, 2), response_token_ids=(3, 4), behavior_logprobs=(-0.5, -1.5)
    )
    replayed = Trajectory(
        "q", "b", 0.0, source=Source.REPLAY, prompt_token_ids=(1, 2), response_token_ids=(5,), behavior_logprobs=(-9.0,)
    )
    batch = build_batch([Group("q", "1", [fresh, replayed])], pad_id=0, with_behavior=True)
    behavior = batch.behavior_logprobs
    assert behavior[0, 1:3].tolist() == [-0.5, -1.5] and torch.isnan(behavior[0, :1]).all()
    assert torch.isnan(behavior[1]).all()  # a replayed row was sampled by another policy: weight 1
    assert (batch.loss_mask.bool() == ~torch.isnan(behavior))[0].all()
    assert build_batch([Group("q", "1", [fresh, replayed])], pad_id=0).behavior_logprobs is None
    assert batch.select([0]).behavior_logprobs.shape == (1, 3)


def test_a_correction_under_tempered_sampling_compares_processed_logprobs_and_greedy_is_refused():
    from pydantic import ValidationError

    from rlep.services.learner.config import TrainConfig

    base = {"model": "m", "data": {"train_files": ["t.parquet"]}}
    untempered = TrainConfig.model_validate(base | {"algorithm": {"behavior_correction": "truncated_is"}})
    assert untempered.algorithm.logprobs_mode == "raw_logprobs"
    for sampler in ({"temperature": 0.7}, {"top_p": 0.95}):
        tempered = TrainConfig.model_validate(base | {"algorithm": {"behavior_correction": "masked_is", **sampler}})
        assert tempered.algorithm.logprobs_mode == "processed_logprobs"
    # Measuring alone compares raw logprobs at any sampling settings (docs/mismatch.md).
    assert TrainConfig.model_validate(base | {"algorithm": {"temperature": 0.7}}).algorithm.logprobs_mode == (
        "raw_logprobs"
    )
    with pytest.raises(ValidationError, match="temperature > 0"):
        TrainConfig.model_validate(base | {"algorithm": {"behavior_correction": "truncated_is", "temperature": 0}})
    with pytest.raises(ValidationError, match="behavior_correction"):
        TrainConfig.model_validate(base | {"algorithm": {"behavior_correction": "sampler"}})


def test_auto_correction_is_truncated_is_only_for_overlapped_untempered_steps():
    from rlep.services.learner.config import AlgorithmConfig

    assert AlgorithmConfig().correction == "none"  # the paper's synchronous step is unchanged
    assert AlgorithmConfig(max_staleness=1).correction == "truncated_is"
    assert AlgorithmConfig(max_staleness=1, temperature=0.7).correction == "none"
    assert AlgorithmConfig(max_staleness=1, behavior_correction="none").correction == "none"
    assert AlgorithmConfig(behavior_correction="truncated_is").correction == "truncated_is"
