"""The learner benchmarks' one batch of random tokens (learner_gpu.py, learner_memory.py, lora.py): the shape of a
real batch for timing and memory, not its content."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlep.common.types import Group, Trajectory
from rlep.services.learner.batch import ExperienceBatch, build_batch


def synthetic_batch(vocab: int, prompt_tokens: int, response_lengths: Sequence[int], seed: int = 0) -> ExperienceBatch:
    """One group, a row per entry of `response_lengths`: `prompt_tokens` random ids, then that many; rewards
    alternate 0 / 1 (advantages about +-1)."""
    generator = torch.Generator().manual_seed(seed)

    def ids(count: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (count,), generator=generator).tolist())

    rows = [
        Trajectory("q", f"r{i}", float(i % 2), prompt_token_ids=ids(prompt_tokens), response_token_ids=ids(n))
        for i, n in enumerate(response_lengths)
    ]
    return build_batch([Group("q", "1", rows)], pad_id=0)
