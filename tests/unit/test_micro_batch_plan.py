"""Micro-batch plans: every row once, longest first, within the row and token caps, the same number of passes on
every process, and token shares balanced across processes."""

from __future__ import annotations

import pytest
import torch

from rlep.services.learner.micro_batch_plan import deal_rows, max_micro_batch_tokens, pack_rows, plan_micro_batches


def _lengths(seed: int = 0, rows: int = 37) -> torch.Tensor:
    return torch.randint(5, 300, (rows,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("max_tokens", [None, 600, 2000])
def test_every_row_runs_once_and_every_process_runs_as_many_passes(world, max_tokens):
    lengths = _lengths()
    rows = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(1))[:29]
    plans = [plan_micro_batches(rows, lengths, rank, world, max_rows=4, max_tokens=max_tokens) for rank in range(world)]
    assert len({len(plan) for plan in plans}) == 1
    trained = [r for plan in plans for micro, scale in plan if scale for r in micro.tolist()]
    assert sorted(trained) == sorted(rows.tolist())
    for plan in plans:
        for micro, _scale in plan:
            assert micro.numel() <= 4
            padded = int(lengths[micro].max()) * micro.numel()
            # A micro-batch over the budget only holds a row too long to share (or a split of one that fit).
            assert max_tokens is None or padded <= max_tokens or micro.numel() == 1
            # The bound the run sizes its LM-head chunks by (policy.py, `head_chunks`) holds for every micro-batch.
            assert padded <= max_micro_batch_tokens(4, max_tokens, longest_row=int(lengths.max()))


def test_token_budget_packs_short_rows_together_and_long_rows_alone():
    lengths = torch.tensor([100, 10, 10, 10, 10, 90, 10])
    packs = pack_rows(torch.tensor([0, 5, 1, 2, 3, 4, 6]), lengths, max_rows=8, max_tokens=100)
    assert [p.tolist() for p in packs] == [[0], [5], [1, 2, 3, 4, 6]]
    # Without a budget only the row cap splits.
    assert [p.tolist() for p in pack_rows(torch.arange(7), lengths, 3, None)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_sorting_by_length_cuts_padding_against_the_order_given():
    lengths = _lengths(seed=3, rows=64)
    rows = torch.arange(64)

    def padded(plan):
        return sum(int(lengths[m].max()) * m.numel() for m, _ in plan)

    unsorted = sum(int(lengths[c].max()) * c.numel() for c in torch.tensor_split(rows, 8))
    assert padded(plan_micro_batches(rows, lengths, 0, 1, max_rows=8)) < 0.8 * unsorted


def test_processes_get_balanced_token_shares():
    lengths = _lengths(seed=5, rows=64)
    shares = [int(lengths[s].sum()) for s in deal_rows(torch.arange(64), lengths, 4)]
    assert max(shares) - min(shares) <= int(lengths.max())


def test_a_process_without_rows_runs_zero_scaled_passes():
    lengths = torch.tensor([50, 40, 30])
    plans = [plan_micro_batches(torch.tensor([2]), lengths, rank, 2, max_rows=2) for rank in range(2)]
    assert [[(m.tolist(), s) for m, s in plan] for plan in plans] == [[([2], 1.0)], [([2], 0.0)]]


def test_a_process_with_fewer_passes_splits_its_micro_batches_before_padding():
    # Dealt longest first: rank 0 holds 1000, 800, 10 (three passes under the budget), rank 1 holds 900, 10, 10
    # (two passes): rank 1 splits its two short rows rather than run a zero-scaled pass.
    lengths = torch.tensor([1000, 900, 800, 10, 10, 10])
    plans = [plan_micro_batches(torch.arange(6), lengths, rank, 2, max_rows=4, max_tokens=1000) for rank in range(2)]
    assert [len(p) for p in plans] == [3, 3]
    assert [(m.tolist(), s) for m, s in plans[1]] == [([1], 1.0), ([3], 1.0), ([5], 1.0)]


def test_no_rows_is_an_error():
    with pytest.raises(ValueError, match="no rows"):
        plan_micro_batches(torch.tensor([], dtype=torch.long), torch.tensor([3]), 0, 1, 4)
