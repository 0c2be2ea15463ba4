"""Training tensors from mixed groups (pure torch): token layout, masks, advantages, mini/micro-batch splits.

Layout: each row is prompt + response token ids, right-padded to the batch's longest row. Position
j of the `[N, L-1]` tensors scores token j+1 (the usual next-token shift), so `loss_mask[i, j]` is
1 exactly where token j+1 of row i is a response token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rlep_common.algorithm import flatten_groups, group_advantages
from rlep_common.types import Group, Source


@dataclass(frozen=True)
class ExperienceBatch:
    tokens: Tensor  # [N, L] long, prompt + response, right-padded
    attention_mask: Tensor  # [N, L] long
    loss_mask: Tensor  # [N, L-1] float, 1 where the next token is a response token
    advantages: Tensor  # [N] float
    rewards: Tensor  # [N] float
    replayed: Tensor  # [N] bool
    group_index: Tensor  # [N] long, which group (question) each row belongs to
    old_logprobs: Tensor | None = None  # [N, L-1] float, filled in before the update

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def select(self, rows: Sequence[int] | Tensor) -> ExperienceBatch:
        """A sub-batch, trimmed to its own longest row (padding costs compute)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        length = int(self.attention_mask[index].sum(dim=1).max().item())
        return ExperienceBatch(
            tokens=self.tokens[index, :length],
            attention_mask=self.attention_mask[index, :length],
            loss_mask=self.loss_mask[index, : length - 1],
            advantages=self.advantages[index],
            rewards=self.rewards[index],
            replayed=self.replayed[index],
            group_index=self.group_index[index],
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs[index, : length - 1],
        )

    def with_old_logprobs(self, old_logprobs: Tensor) -> ExperienceBatch:
        if old_logprobs.shape != self.loss_mask.shape:
            raise ValueError(f"old_logprobs must be {tuple(self.loss_mask.shape)}, got {tuple(old_logprobs.shape)}")
        return replace(self, old_logprobs=old_logprobs)


def build_batch(groups: Sequence[Group], pad_id: int) -> ExperienceBatch:
    """Tensors for every trajectory of `groups`; advantages normalised within each mixed group.

    Every trajectory needs `prompt_token_ids` and at least one `response_token_ids`.
    """
    trajectories, rewards, group_ids = flatten_groups(groups)
    if not trajectories:
        raise ValueError("no trajectories to train on")
    rows = []
    for t in trajectories:
        if not t.prompt_token_ids or not t.response_token_ids:
            raise ValueError(f"trajectory {t.id[:12]} of question {t.question_id} lacks prompt or response tokens")
        rows.append((list(t.prompt_token_ids), list(t.response_token_ids)))
    length = max(len(p) + len(r) for p, r in rows)
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), length - 1), dtype=torch.float32)
    for i, (prompt, response) in enumerate(rows):
        total = len(prompt) + len(response)
        tokens[i, :total] = torch.tensor(prompt + response)
        attention[i, :total] = 1
        loss_mask[i, len(prompt) - 1 : total - 1] = 1.0
    return ExperienceBatch(
        tokens=tokens,
        attention_mask=attention,
        loss_mask=loss_mask,
        advantages=group_advantages(rewards, group_ids),
        rewards=rewards,
        replayed=torch.tensor([t.source == Source.REPLAY for t in trajectories]),
        group_index=group_ids,
    )


def mini_batches(size: int, count: int, generator: torch.Generator | None = None) -> list[Tensor]:
    """Splits row indices [0, size) into `count` nearly equal mini-batches (shuffled when a generator is given)."""
    order = torch.randperm(size, generator=generator) if generator is not None else torch.arange(size)
    return [chunk for chunk in torch.tensor_split(order, min(count, size)) if chunk.numel()]


def micro_batches(rows: Tensor, micro_size: int) -> Iterator[Tensor]:
    for start in range(0, rows.numel(), micro_size):
        yield rows[start : start + micro_size]


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """`[N, L, V]` logits and `[N, L]` tokens -> `[N, L-1]` log-probability of each next token."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def token_entropy(logits: Tensor) -> Tensor:
    """`[N, L, V]` -> `[N, L-1]` entropy of the next-token distribution (no gradient needed)."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)
