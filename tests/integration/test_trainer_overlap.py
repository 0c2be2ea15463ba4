"""Overlapped steps (`algorithm.max_staleness` = k >= 1): generation runs ahead of training, and no step trains on
a fresh sample generated more than k weight versions before the weights it updates.

Real verifier and replay; the rollout answers from the script of test_trainer_groups.py, stamping each
sample with the version it serves (the last one pushed), or a frozen one for a replica that stopped taking
pushes. The policy records what it is given.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_trainer_groups import QUESTIONS, make_trainer, stored, tokenizer  # noqa: F401 - a fixture

pytestmark = [pytest.mark.integration]


def test_overlapped_steps_stay_within_the_bound_and_record_it(tokenizer, verifier_client, replay_client, pool_name):  # noqa: F811
    """Replay works unchanged: every step mixes M=2 stored successes into each fresh group."""
    answers = [stored(tokenizer, q, f"{tag} \\boxed{{{q.ground_truth}}}") for q in QUESTIONS for tag in "ab"]
    replay_client.add(pool_name, answers)
    trainer, policy, rollout = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=2, max_staleness=1
    )
    try:
        records = [trainer.train_step() for _ in range(4)]
    finally:
        trainer.close()

    assert [r.step for r in records] == [1, 2, 3, 4] and len(policy.updates) == 4
    assert all(r.policy_staleness_max <= 1 and r.groups_dropped_stale == 0 for r in records)
    assert records[0].policy_staleness_max == 0  # the first step's samples come from the weights it trains
    assert all("rollout_wait" in r.phase_seconds for r in records)
    assert all(r.replay_used == 2 * len(QUESTIONS) and r.sequences == 6 * len(QUESTIONS) for r in records)
    # Each step trains on its own questions, in the synchronous order (the cursor is drawn by one thread).
    assert [r.question_ids for r in records] == [[q.question_id for q in QUESTIONS]] * 4
    assert rollout.pushed == [1, 2, 3, 4, 5]


def test_a_replica_stuck_on_old_weights_is_never_trained_on(tokenizer, verifier_client, replay_client, pool_name):  # noqa: F811
    """Once the stuck replica's samples are staler than k, the step drops them, generates again after bringing
    the replicas up, and refuses to train when the samples are still stale."""
    trainer, policy, rollout = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=0, max_staleness=1
    )
    # Stuck from the start, not from after step 1: step 2's samples are gathered on the background thread while
    # step 1 trains, so whether they say version 1 or 2 would otherwise depend on which thread is first (CI saw 2).
    rollout.frozen_version = 1  # every sample says version 1
    try:
        assert trainer.train_step().policy_staleness_max == 0  # trains version 1 -> pushes 2
        record = trainer.train_step()  # trains version 2: samples of version 1 are 1 stale, allowed
        assert record.policy_staleness_max == 1
        with pytest.raises(RuntimeError, match="staler than max_staleness=1.*not taking weight pushes"):
            trainer.train_step()  # trains version 3: version-1 samples are 2 stale
    finally:
        trainer.close()
    assert len(policy.updates) == 2  # the refused step trained on nothing


def test_old_logprobs_are_the_learners_not_the_stale_samplers(tokenizer, verifier_client, replay_client, pool_name):  # noqa: F811
    """The importance ratio of an update is pi_new / pi_old with pi_old recomputed under the learner's weights at
    the start of the update (docs/learner.md, *Overlap*): the sampler's own logprobs (here -3.0 a token, a stale
    sampler's) never reach the loss."""
    trainer, policy, rollout = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=0, max_staleness=1
    )
    rollout.sampler_logprob = -3.0
    try:
        trainer.train_step()
        trainer.train_step()
    finally:
        trainer.close()
    for batch, _ in policy.updates:
        assert batch.old_logprobs is not None and torch.equal(batch.old_logprobs, policy.logprobs(batch))


def test_truncated_is_hands_the_samplers_logprobs_of_fresh_rows_to_the_update(
    tokenizer,  # noqa: F811
    verifier_client,
    replay_client,
    pool_name,
):
    """With behavior_correction=truncated_is the batch carries each fresh token's sampler logprob (-3.0 here) where
    the loss counts it, and NaN (weight 1) for replayed rows; with the default it carries none."""
    answers = [stored(tokenizer, q, f"{tag} \\boxed{{{q.ground_truth}}}") for q in QUESTIONS for tag in "ab"]
    replay_client.add(pool_name, answers)
    trainer, policy, rollout = make_trainer(
        tokenizer,
        verifier_client,
        replay_client,
        pool_name,
        replayed_per_question=2,
        max_staleness=1,
        behavior_correction="truncated_is",
    )
    rollout.sampler_logprob = -3.0
    try:
        trainer.train_step()
    finally:
        trainer.close()
    ((batch, _),) = policy.updates
    fresh, replayed = ~batch.replayed, batch.replayed
    assert replayed.sum() == 2 * len(QUESTIONS)
    counted = batch.loss_mask[fresh].bool()
    assert torch.all(batch.behavior_logprobs[fresh][counted] == -3.0)
    assert torch.isnan(batch.behavior_logprobs[fresh][~counted]).all()
    assert torch.isnan(batch.behavior_logprobs[replayed]).all()
