"""Training tensors from mixed groups (pure torch): token layout, masks, advantages, mini/micro-batch splits,
and the per-token logprobs and entropy of a batch under the policy.

Layout: each row is prompt + response token ids, right-padded to the batch's longest row. Position
j of the `[N, L-1]` tensors scores token j+1 (the usual next-token shift), so `loss_mask[i, j]` is
1 exactly where token j+1 of row i is a response token.

Scores without a full-vocabulary tensor: `token_scores` applies the LM head to a chunk of positions
at a time and reduces each chunk's float32 log-softmax to the target's logprob and the entropy
before the next chunk, under activation checkpointing, so backward recomputes a chunk's logits
instead of keeping them. Peak memory is a few `[chunk, V]` blocks instead of several `[N, L, V]`
float32 copies (~20 GB each at 8 x 4096 tokens and a 151,936-token vocabulary). `ScoringModel` runs
an HF causal LM that way; `token_logprobs` / `token_entropy` are the full-vocabulary reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlep.common.types import Group, Source
from rlep.services.learner.algorithm import KlEstimator, NonFiniteError, flatten_groups, group_advantages, kl_estimate

log = logging.getLogger(__name__)


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
    behavior_logprobs: Tensor | None = None  # [N, L-1] float, the sampler's; NaN where none (only when asked)
    ref_logprobs: Tensor | None = None  # [N, L-1] float, the reference policy's (only with a KL term)
    # [N, L-1] float, the old policy as the sampler draws from it (temperature, top-p; `processed_logprobs`): only
    # with a behavior correction under tempered sampling, whose weights it then gives (mismatch.py)
    old_processed_logprobs: Tensor | None = None

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
            behavior_logprobs=(None if self.behavior_logprobs is None else self.behavior_logprobs[index, : length - 1]),
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[index, : length - 1],
            old_processed_logprobs=(
                None if self.old_processed_logprobs is None else self.old_processed_logprobs[index, : length - 1]
            ),
        )

    def to(self, device: torch.device) -> ExperienceBatch:
        """The batch's tensors on `device`; to CUDA through pinned memory, without waiting for the copies."""
        if device.type == "cpu":
            return self
        pinned = device.type == "cuda"

        def move(tensor: Tensor | None) -> Tensor | None:
            if tensor is None:
                return None
            return tensor.pin_memory().to(device, non_blocking=True) if pinned else tensor.to(device)

        return ExperienceBatch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def with_old_logprobs(self, old_logprobs: Tensor) -> ExperienceBatch:
        if old_logprobs.shape != self.loss_mask.shape:
            raise ValueError(f"old_logprobs must be {tuple(self.loss_mask.shape)}, got {tuple(old_logprobs.shape)}")
        return replace(self, old_logprobs=old_logprobs)

    def with_ref_logprobs(self, ref_logprobs: Tensor) -> ExperienceBatch:
        if ref_logprobs.shape != self.loss_mask.shape:
            raise ValueError(f"ref_logprobs must be {tuple(self.loss_mask.shape)}, got {tuple(ref_logprobs.shape)}")
        return replace(self, ref_logprobs=ref_logprobs)

    def with_old_processed_logprobs(self, logprobs: Tensor) -> ExperienceBatch:
        if logprobs.shape != self.loss_mask.shape:
            raise ValueError(
                f"old_processed_logprobs must be {tuple(self.loss_mask.shape)}, got {tuple(logprobs.shape)}"
            )
        return replace(self, old_processed_logprobs=logprobs)


def layout_rows(rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """The token layout of (prompt ids, response ids) rows (see the module docstring).

    Returns `tokens` `[N, L]` long (prompt + response, right-padded with `pad_id` to the longest row),
    `attention_mask` `[N, L]` long, and `loss_mask` `[N, L-1]` float, 1 where the next token is a
    response token. Every prompt needs at least one token.
    """
    length = max(len(p) + len(r) for p, r in rows)
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), length - 1), dtype=torch.float32)
    for i, (prompt, response) in enumerate(rows):
        total = len(prompt) + len(response)
        tokens[i, :total] = torch.tensor([*prompt, *response])
        attention[i, :total] = 1
        loss_mask[i, len(prompt) - 1 : total - 1] = 1.0
    return tokens, attention, loss_mask


def build_batch(groups: Sequence[Group], pad_id: int, with_behavior: bool = False) -> ExperienceBatch:
    """Tensors for every trajectory of `groups`; advantages normalised within each mixed group.

    Every trajectory needs `prompt_token_ids`, at least one `response_token_ids` and a finite reward;
    `NonFiniteError` names the trajectory whose reward (or advantage) is NaN or infinite. With
    `with_behavior`, the batch also carries the sampler's logprobs in the `loss_mask` layout (NaN where a
    row has none: replayed rows, which were sampled by another policy for another prompt rendering). A tool
    episode's tool tokens (`Trajectory.response_mask` 0) get loss mask 0 and no sampler logprob, and so does every
    token of an episode `excluded_from_loss` (its reward still counts in its group's advantages).
    """
    trajectories, rewards, group_ids = flatten_groups(groups)
    if not trajectories:
        raise ValueError("no trajectories to train on")
    try:
        advantages = group_advantages(rewards, group_ids)
    except NonFiniteError as err:
        t = trajectories[err.index]
        raise NonFiniteError(
            f"refusing to train: trajectory {t.id[:12]} ({t.source.value} answer to question {t.question_id!r}, "
            f"reward {t.reward}): {err}",
            err.index,
        ) from err
    rows = []
    for t in trajectories:
        if not t.prompt_token_ids or not t.response_token_ids:
            raise ValueError(f"trajectory {t.id[:12]} of question {t.question_id} lacks prompt or response tokens")
        rows.append((list(t.prompt_token_ids), list(t.response_token_ids)))
    tokens, attention, loss_mask = layout_rows(rows, pad_id)
    untrained = torch.zeros_like(loss_mask, dtype=torch.bool)  # a tool episode's tool outputs (response_mask 0)
    for i, t in enumerate(trajectories):
        if t.response_mask:
            start = len(t.prompt_token_ids) - 1
            mask = torch.tensor(t.response_mask)
            untrained[i, start : start + len(mask)] = True if t.excluded_from_loss else mask == 0
    loss_mask[untrained] = 0.0
    behavior = None
    if with_behavior:
        behavior = torch.full(loss_mask.shape, float("nan"))
        for i, t in enumerate(trajectories):
            if t.behavior_logprobs and t.source != Source.REPLAY:
                start = len(t.prompt_token_ids) - 1
                behavior[i, start : start + len(t.behavior_logprobs)] = torch.tensor(t.behavior_logprobs)
        behavior[untrained] = float("nan")  # no sampler wrote them, or left out: outside every importance ratio
    return ExperienceBatch(
        tokens=tokens,
        attention_mask=attention,
        loss_mask=loss_mask,
        advantages=advantages,
        rewards=rewards,
        replayed=torch.tensor([t.source == Source.REPLAY for t in trajectories]),
        group_index=group_ids,
        behavior_logprobs=behavior,
    )


def with_kl_reward_penalty(batch: ExperienceBatch, kl_coef: float, estimator: KlEstimator) -> ExperienceBatch:
    """`batch` whose rewards lose `kl_coef` x each row's summed per-token KL estimate between the old policy and the
    reference (verl `use_kl_in_reward`), and whose advantages are normalised again from them."""
    if batch.old_logprobs is None or batch.ref_logprobs is None:
        raise ValueError("a KL reward penalty needs old and reference logprobs")
    per_token = kl_estimate(batch.old_logprobs, batch.ref_logprobs, estimator) * batch.loss_mask
    rewards = batch.rewards - kl_coef * per_token.sum(dim=1)
    return replace(batch, rewards=rewards, advantages=group_advantages(rewards, batch.group_index))


def mini_batches(size: int, count: int, generator: torch.Generator | None = None) -> list[Tensor]:
    """Splits row indices [0, size) into `count` nearly equal mini-batches (shuffled when a generator is given)."""
    order = torch.randperm(size, generator=generator) if generator is not None else torch.arange(size)
    return [chunk for chunk in torch.tensor_split(order, min(count, size)) if chunk.numel()]


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """`[N, L, V]` logits and `[N, L]` tokens -> `[N, L-1]` logprob of each next token (full-vocab reference)."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def processed_logprobs(logits: Tensor, targets: Tensor, temperature: float, top_p: float) -> Tensor:
    """`[C, V]` logits and `[C]` targets -> `[C]` logprob of each target under the distribution a sampler at
    `temperature` and `top_p` draws from: vLLM's `processed_logprobs` (v1 sampler, `apply_top_k_top_p_pytorch`):
    float32 logits / temperature; the top-p nucleus keeps, in descending probability, the tokens whose smaller
    neighbours' mass exceeds 1 - top_p (always the most likely one); log-softmax over the nucleus. A target outside
    the nucleus gets -inf (the sampler could not have drawn it)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding has no sampling distribution), got {temperature}")
    scaled = logits.float() / temperature
    if top_p < 1.0:
        ascending, order = scaled.sort(dim=-1)
        dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[:, -1] = False  # at least the most likely token
        scaled = scaled.masked_fill(torch.zeros_like(dropped).scatter_(-1, order, dropped), float("-inf"))
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def token_entropy(logits: Tensor) -> Tensor:
    """`[N, L, V]` -> `[N, L-1]` entropy of the next-token distribution (full-vocab reference, no gradient)."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


# Positions per chunk at most. A float32 `[1024, 151936]` block is 0.6 GB and a chunk's forward or backward
# holds ~3 of them; the head's matmul stays large enough to run at full speed.
SCORE_CHUNK_POSITIONS = 1024


def score_chunk_count(max_positions: int, chunk_positions: int = SCORE_CHUNK_POSITIONS) -> int:
    """How many chunks a run splits every forward's positions into: enough that the largest micro-batch it can
    make (`max_positions` = rows x row length at most) has <= `chunk_positions` per chunk.

    Why one count for the whole run: ZeRO-3 records the order in which modules run in one forward + backward and
    prefetches parameters by it; a micro-batch whose head runs a different number of times breaks that trace and
    DeepSpeed drops it ("Invalidate trace cache"), then fetches every parameter on demand and re-gathers the head
    for each chunk. With the same count every micro-batch, the trace holds and the head stays gathered across its
    chunks (DeepSpeed keeps a parameter it will use again soon).
    """
    return max(1, -(-max_positions // chunk_positions))


def _chunk_scores(
    head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    with_entropy: bool,
    entropy_grad: bool = False,
    sampling: LogitProcessing | None = None,
):
    """`[C, H]` inputs of the head and `[C]` targets -> (`[C]` logprobs, `[C]` entropy or None)."""
    if sampling is not None:  # the model's own logprobs and those of the distribution the sampler draws from
        logits = head(hidden)
        raw = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        return raw, processed_logprobs(logits, targets, *sampling)
    # The fused log_softmax is faster on CPU than logsumexp + subtraction, and is the reference's formula.
    chunk_logprobs = torch.log_softmax(head(hidden).float(), dim=-1)  # [C, V]
    logprobs = chunk_logprobs.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logprobs, None
    # -sum(p * log p) as a batched dot product: no third [C, V] temporary. Detached unless an entropy bonus trains
    # on it (after the logprobs, so checkpointing's recompute stops before this part when it is not needed).
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(chunk_logprobs.exp()[:, None, :] @ chunk_logprobs[:, :, None]).view(-1)
    return logprobs, entropy


class LogitProcessing(NamedTuple):
    """How a sampler processes the logits it draws from: temperature, then top-p. `token_scores` given one returns
    the logprobs of that processed distribution (`processed_logprobs`) instead of the model's own."""

    temperature: float
    top_p: float


def token_scores(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    tokens: Tensor,
    with_entropy: bool = True,
    chunk_positions: int = SCORE_CHUNK_POSITIONS,
    entropy_grad: bool = False,
    sampling: LogitProcessing | None = None,
    chunks: int = 1,
) -> tuple[Tensor, Tensor | None]:
    """Logprob and entropy of every next token, `chunk_positions` positions at a time (positions = N x (L-1)), in
    `max(chunks, ceil(positions / chunk_positions))` chunks: the head runs exactly `chunks` times whenever they hold
    the positions (`score_chunk_count`), whatever the batch's shape; the last ones may be empty.

    Values equal `token_logprobs(head(hidden), tokens)` and `token_entropy(head(hidden))`; the
    gradient flows through the logprobs only. When a gradient is needed each chunk runs under
    `torch.utils.checkpoint`, so only `hidden` is kept for backward.

    Args:
        hidden: `[N, L, H]` inputs of the head at every position (final hidden states; or the logits
            themselves with `head` the identity).
        head: maps `[C, H]` to `[C, V]` logits (an LM head module).
        tokens: `[N, L]` token ids; position j is scored against token j+1.
        with_entropy: also compute the entropy (detached); None in its place otherwise.
        entropy_grad: let the gradient flow through the entropy too (an entropy bonus).
        sampling: a sampler whose distribution to score too (`processed_logprobs`, from the same logits): it
            takes the entropy's place in the result.
        chunks: how many times the head runs at least (a run's `score_chunk_count`; 1: as many as needed).

    Returns:
        `([N, L-1] float32 logprobs, [N, L-1] float32 entropy or None)`; with `sampling`, the processed logprobs in
        place of the entropy.
    """
    with_entropy = with_entropy and sampling is None
    rows, length = tokens.shape
    flat_hidden = hidden[:, :-1].reshape(rows * (length - 1), hidden.shape[-1])  # [N*(L-1), H]
    targets = tokens[:, 1:].reshape(-1)  # [N*(L-1)]
    logprobs, entropy = [], []
    positions = targets.numel()
    pieces = [(flat_hidden[i : i + chunk_positions], targets[i : i + chunk_positions])
              for i in range(0, positions, chunk_positions)]  # fmt: skip
    # Fixed-size slices, as before the count was fixed: the same matmul shapes give bit-identical scores outside
    # ZeRO-3 (near-equal splits moved the demo's table). Empty chunks make up the count: the head still runs.
    pieces += [(flat_hidden[positions:], targets[positions:])] * (chunks - len(pieces))
    for chunk_hidden, chunk_targets in pieces:
        chunk = (head, chunk_hidden, chunk_targets)
        if torch.is_grad_enabled() and sampling is None:
            lp, ent = checkpoint(_chunk_scores, *chunk, with_entropy, entropy_grad, use_reentrant=False)
        else:
            lp, ent = _chunk_scores(*chunk, with_entropy, sampling=sampling)
        logprobs.append(lp)
        entropy.append(ent)
    shape = (rows, length - 1)
    second = with_entropy or sampling is not None
    return torch.cat(logprobs).view(shape), torch.cat(entropy).view(shape) if second else None


# transformers model types whose logits are exactly `lm_head(decoder(...).last_hidden_state)`, and
# config fields of others that transform logits after the head (Gemma's softcapping, Cohere's scale,
# Granite's scaling): such models, and any type not listed, take the full-logits path.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
LOGIT_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def has_plain_lm_head(config) -> bool:
    """Whether an HF config's logits are just `lm_head(hidden)`, so the head can be applied in chunks."""
    return config.model_type in PLAIN_HEAD_MODEL_TYPES and all(
        getattr(config, field, None) is None for field in LOGIT_TRANSFORM_FIELDS
    )


class ScoringModel(torch.nn.Module):
    """An HF causal LM whose forward returns per-token logprobs and entropy instead of logits.

    It is the module handed to DeepSpeed, so the whole computation happens inside the engine's
    forward and the loss depends on the engine's outputs only: DeepSpeed starts its backward
    bookkeeping from hooks on those outputs, and ZeRO-3 gathers the head's weight through the head's
    own module hooks, chunk by chunk and again when backward recomputes a chunk. Under ZeRO-3 the policy
    gives it `chunks` (`score_chunk_count`), so the head runs as many times in every micro-batch and
    DeepSpeed's prefetch trace holds; a batch larger than the run's bound runs more chunks, with a warning.

    Models with a plain LM head (`has_plain_lm_head`) run the decoder and `token_scores` over its
    hidden states: full logits are never built. Others (softcapped or scaled logits) fall back to
    the model's full logits, still reduced chunk by chunk without a float32 log-softmax copy of them.

    `state_dict` / `load_state_dict` are the model's own, so checkpoints keep HF parameter names.
    """

    def __init__(self, model: torch.nn.Module, chunk_positions: int = SCORE_CHUNK_POSITIONS, chunks: int = 1):
        super().__init__()
        self.model = model
        self.chunk_positions = chunk_positions
        self.chunks = chunks
        self.plain_head = has_plain_lm_head(model.config)
        self._warned_over_bound = False

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        with_entropy: bool = True,
        entropy_grad: bool = False,
        sampling: LogitProcessing | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """`[N, L]` ids and mask -> (`[N, L-1]` logprobs, `[N, L-1]` entropy or None); see `token_scores`."""
        if self.plain_head:
            decoder = self.model.get_decoder()
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            head = self.model.get_output_embeddings()
        else:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            head = torch.nn.Identity()
        positions = input_ids.shape[0] * (input_ids.shape[1] - 1)
        if self.chunks > 1 and positions > self.chunks * self.chunk_positions and not self._warned_over_bound:
            self._warned_over_bound = True
            log.warning(
                "a micro-batch of %d positions exceeds the %d x %d this run's head chunks were sized for: the head "
                "runs more times there, and ZeRO-3 drops its prefetch trace for it (warned once)",
                positions,
                self.chunks,
                self.chunk_positions,
            )
        return token_scores(
            hidden, head, input_ids, with_entropy, self.chunk_positions, entropy_grad, sampling, chunks=self.chunks
        )

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)
