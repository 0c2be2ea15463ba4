"""Which rows each learner process runs in which micro-batch (pure logic over row lengths).

A mini-batch's rows are dealt to the data-parallel processes longest first, round robin, so every
process gets a similar number of tokens; each process then packs its rows, longest first, into
micro-batches of at most `max_rows` rows and, with a token budget, at most `max_tokens` padded
tokens (rows x the micro-batch's longest row; a longer row runs alone). Sorting by length is what
makes padding cheap: neighbours in a micro-batch have similar lengths (verl's `use_dynamic_bsz`
balances and buckets the same way, counting real tokens because it removes padding; we keep the
padding, so we count it).

Every process must run the same number of forward/backward passes: ZeRO-3 gathers parameters and
ZeRO-1/2 reduce gradients collectively, pass by pass. Each process computes every process's plan
from the same rows (no communication), then brings its own up to the largest count, first by
splitting its largest micro-batches and, when it has fewer rows than passes, with one-row passes
whose loss is scaled to zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

MicroBatch = tuple[Tensor, float]
"""(row indices `[R]` long, loss scale: 1.0, or 0.0 for a padding pass whose result is discarded)."""


def deal_rows(rows: Tensor, lengths: Tensor, world_size: int) -> list[Tensor]:
    """`rows` `[R]` dealt to `world_size` processes longest first (`lengths` `[N]`: tokens of every row)."""
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    return [order[rank::world_size] for rank in range(world_size)]


def pack_rows(rows: Tensor, lengths: Tensor, max_rows: int, max_tokens: int | None) -> list[Tensor]:
    """Consecutive `rows` (longest first) into micro-batches of <= `max_rows` rows and <= `max_tokens`
    padded tokens (None = no token budget)."""
    packs: list[list[int]] = []
    longest = 0
    for row in rows.tolist():
        length = int(lengths[row])
        if packs:
            current = packs[-1]
            padded = max(longest, length) * (len(current) + 1)
            if len(current) < max_rows and (max_tokens is None or padded <= max_tokens):
                current.append(row)
                longest = max(longest, length)
                continue
        packs.append([row])
        longest = length
    return [torch.tensor(p, dtype=torch.long) for p in packs]


def _split_to(packs: list[Tensor], count: int) -> list[Tensor]:
    """Splits the micro-batches with the most rows in two until there are `count` (or none has 2 rows)."""
    packs = list(packs)
    while len(packs) < count:
        largest = max(range(len(packs)), key=lambda i: packs[i].numel(), default=None)
        if largest is None or packs[largest].numel() < 2:
            break
        packs[largest : largest + 1] = list(torch.tensor_split(packs[largest], 2))
    return packs


def plan_micro_batches(
    rows: Tensor, lengths: Tensor, rank: int, world_size: int, max_rows: int, max_tokens: int | None = None
) -> list[MicroBatch]:
    """Process `rank`'s micro-batches of `rows`; every process gets the same number (module docstring).

    Args:
        rows: `[R]` long, the rows to run (a mini-batch, or the whole batch for old logprobs).
        lengths: `[N]` long, prompt + response tokens of every row of the batch.
        rank / world_size: this process and the number of data-parallel processes.
        max_rows: rows per micro-batch at most.
        max_tokens: padded tokens per micro-batch at most (None = rows only).

    Returns:
        `(row indices, loss scale)` per micro-batch; a process left without rows gets one-row passes
        (the mini-batch's first row) with scale 0.
    """
    if rows.numel() == 0:
        raise ValueError("no rows to plan micro-batches for")
    plans = [pack_rows(share, lengths, max_rows, max_tokens) for share in deal_rows(rows, lengths, world_size)]
    count = max(len(plan) for plan in plans)
    mine = _split_to(plans[rank], count)
    return [(pack, 1.0) for pack in mine] + [(rows[:1], 0.0)] * (count - len(mine))


def max_micro_batch_tokens(max_rows: int, max_tokens: int | None, longest_row: int) -> int:
    """The most padded tokens (rows x longest row) a micro-batch of `plan_micro_batches` can hold, for rows of at
    most `longest_row` tokens: `max_rows` rows of it, or with a token budget the budget (a row over it runs alone)."""
    most = max_rows * longest_row
    return most if max_tokens is None else min(most, max(max_tokens, longest_row))
