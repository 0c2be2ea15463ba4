"""Priorities of stored successes from what the policy makes of them (issue 48, `replay_priority: policy_surprise`).

A replayed answer teaches little once the policy samples it itself (docs/results.md: late in the miniature the
policy gave its replayed answers probability 0.73, and replay stopped rescuing groups). The old-logprob pass already
scores every replayed row under the policy about to be updated, so its surprise costs nothing to measure: each
replayed row's stored success gets priority max(floor, 1 - p), p = exp(mean logprob per response token), the
geometric-mean chance per token (the chance of the whole answer, exp(sum), vanishes for any long answer and would
rank by length). `replay_strategy: prioritized` then draws a question's successes in proportion to it, so answers
the policy has not learned come first. ExGRPO (arXiv 2510.02245) prefers the opposite within a question (the
answer of lowest entropy, for its quality); this follows the issue's rule, which asks for the surprise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlep.common.types import Trajectory


def policy_surprise(old_logprobs: Tensor, loss_mask: Tensor, floor: float) -> Tensor:
    """`[N]` priorities max(floor, 1 - exp(mean logprob over each row's response tokens)); `old_logprobs` and
    `loss_mask` are `[N, L-1]` (prompt and padding positions masked out). A row without tokens gets 1."""
    tokens = loss_mask.sum(dim=1)
    mean = (old_logprobs * loss_mask).sum(dim=1) / tokens.clamp(min=1)
    surprise = 1.0 - torch.exp(mean)
    return torch.where(tokens > 0, surprise.clamp(min=floor, max=1.0), torch.ones_like(surprise))


def priority_updates(
    trajectories: Sequence[Trajectory], replayed: Tensor, priorities: Tensor
) -> list[tuple[str, str, float]]:
    """(question id, trajectory id, priority) for every replayed row; `trajectories` in batch order."""
    return [(t.question_id, t.id, float(priorities[i])) for i, t in enumerate(trajectories) if bool(replayed[i])]
