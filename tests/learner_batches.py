"""A small batch of mixed groups for learner tests (tests/integration/test_learner_policy.py, tests/gpu/)."""

from __future__ import annotations

import torch

from rlep.common.types import Group, Source, Trajectory
from rlep.services.learner.batch import ExperienceBatch, build_batch


def synthetic_batch(vocab: int, pad_id: int = 0, seed: int = 0) -> ExperienceBatch:
    """4 questions x (3 fresh + 1 replayed) random responses of 3-13 tokens after 5-8 prompt tokens, rewards +-1."""
    generator = torch.Generator().manual_seed(seed)

    def ids(count: int) -> tuple[int, ...]:
        return tuple(int(t) for t in torch.randint(2, vocab, (count,), generator=generator))

    groups = []
    for q in range(4):
        prompt = ids(5 + q)
        trajectories = [
            Trajectory(
                f"q{q}",
                f"response {k}",
                reward=1.0 if (q + k) % 3 == 0 else -1.0,
                source=Source.REPLAY if k == 3 else Source.FRESH,
                prompt_token_ids=prompt,
                response_token_ids=ids(int(torch.randint(3, 14, (1,), generator=generator))),
            )
            for k in range(4)
        ]
        groups.append(Group(f"q{q}", "0", trajectories))
    return build_batch(groups, pad_id)
