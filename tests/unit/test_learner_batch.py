"""Pure learner logic: batch layout and advantages, mini/micro-batch splits, the data cursor, verl data."""

from __future__ import annotations

import pytest
import torch

from rlep.common.types import Group, Source, Trajectory, Verdict
from rlep.services.learner.batch import build_batch, mini_batches, token_logprobs
from rlep.services.learner.cursor import DataCursor, load_questions
from tests.conftest import TEST_DATA


def trajectory(qid: str, response: tuple[int, ...], reward: float, source=Source.FRESH) -> Trajectory:
    verdict = Verdict.CORRECT if reward > 0 else Verdict.WRONG
    return Trajectory(
        qid,
        f"r{response}",
        reward,
        source=source,
        verdict=verdict,
        prompt_token_ids=(5, 6, 7),
        response_token_ids=response,
    )


def test_layout_masks_exactly_the_response_tokens():
    groups = [Group("a", "1", [trajectory("a", (8, 9), 1.0), trajectory("a", (10,), -1.0)])]
    batch = build_batch(groups, pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # position j scores token j+1: responses start at token 3, i.e. position 2
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert batch.response_tokens == 3


def test_advantages_are_normalised_over_the_mixed_group():
    fresh = [trajectory("a", (8,), r) for r in (-1.0, -1.0, -1.0, 1.0)]
    replayed = [trajectory("a", (9,), 1.0, Source.REPLAY) for _ in range(2)]
    other = [trajectory("b", (8,), r) for r in (1.0, 1.0)]
    batch = build_batch([Group("a", "1", fresh + replayed), Group("b", "2", other)], pad_id=0)
    rewards = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    assert torch.allclose(batch.advantages[:6], expected)
    assert batch.advantages[6:].tolist() == [0.0, 0.0]  # all-equal group: no signal
    assert batch.replayed.tolist() == [False] * 4 + [True] * 2 + [False] * 2
    assert batch.group_index.tolist() == [0] * 6 + [1] * 2


def test_trajectories_without_tokens_are_refused():
    bad = Trajectory("a", "x", 1.0, prompt_token_ids=(1,), response_token_ids=())
    with pytest.raises(ValueError, match="lacks prompt or response tokens"):
        build_batch([Group("a", "1", [bad])], pad_id=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards_are_refused_naming_the_trajectory(bad):
    from rlep.services.learner.algorithm import NonFiniteError

    poisoned = trajectory("b", (9,), bad, Source.REPLAY)
    groups = [Group("a", "1", [trajectory("a", (8,), 1.0)]), Group("b", "2", [trajectory("b", (8,), 0.0), poisoned])]
    with pytest.raises(NonFiniteError, match=rf"trajectory {poisoned.id[:12]} \(replay answer to question 'b'"):
        build_batch(groups, pad_id=0)


def test_select_trims_padding_and_keeps_rows_aligned():
    groups = [Group("a", "1", [trajectory("a", (8, 9, 10, 11), 1.0), trajectory("a", (12,), -1.0)])]
    batch = build_batch(groups, pad_id=0)
    batch = batch.with_old_logprobs(torch.arange(batch.loss_mask.numel(), dtype=torch.float32).view_as(batch.loss_mask))
    short = batch.select([1])
    assert short.tokens.tolist() == [[5, 6, 7, 12]]
    assert short.old_logprobs.shape == (1, 3) and short.old_logprobs[0].tolist() == batch.old_logprobs[1, :3].tolist()


def test_mini_batches_partition_the_rows():
    generator = torch.Generator().manual_seed(0)
    minis = mini_batches(10, 3, generator)
    assert sorted(torch.cat(minis).tolist()) == list(range(10)) and [len(m) for m in minis] == [4, 3, 3]


def test_token_logprobs_score_the_next_token():
    logits = torch.log(torch.tensor([[[0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]]))
    tokens = torch.tensor([[0, 1, 2]])  # row j's distribution scores token j+1
    assert torch.allclose(token_logprobs(logits, tokens), torch.log(torch.tensor([[0.5, 0.8]])))


def test_cursor_covers_every_question_once_per_epoch_and_restores():
    cursor = DataCursor(10, seed=1)
    first_epoch = cursor.next_indices(4) + cursor.next_indices(4) + cursor.next_indices(2)
    assert sorted(first_epoch) == list(range(10))
    state = cursor.state()
    upcoming = cursor.next_indices(7)
    other = DataCursor(10, seed=1)
    other.restore(state)
    assert other.next_indices(7) == upcoming
    with pytest.raises(ValueError, match="seed"):
        DataCursor(10, seed=2).restore(state)


def test_dapo_17k_loads_as_is():
    questions = load_questions([TEST_DATA / "dapo_math_17k.parquet"])  # its first 200 rows, verl's schema
    assert len(questions) == 200
    first = questions[0]
    assert first.data_source == "DAPO-17k" and first.ground_truth == "34"
    assert first.chat()[0]["role"] == "user" and "triangle" in first.chat()[0]["content"]
    assert len({q.question_id for q in questions}) == 199  # repeated prompts share an id: rows 35 and 179
    assert questions[35].question_id == questions[179].question_id
