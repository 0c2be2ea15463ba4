"""RLEP's algorithm core: group advantages, DAPO's policy loss and overlong shaping (pure torch).

Paper: RLEP, "Reinforcement Learning with Experience rePlay for LLM Reasoning" (arXiv 2507.07451).
Every training question gets G fresh rollouts plus M replayed successes; advantages are normalised
over the mixed group of G + M (eq. 1/5), and the policy is updated with DAPO's clipped objective
(eq. 3/4): token-mean aggregation, asymmetric "clip-higher" range, dual-clip for negative advantages.

Numerics follow verl (`compute_grpo_outcome_advantage`, `compute_policy_loss` with dual-clip, DAPO's
overlong reward) so that results can be compared with the reference recipe. Departures:
- `group_advantages` is vectorised (scatter over group ids) instead of verl's per-sample loop.
- `policy_loss` accepts a `normalizer` (`mini_batch_normalizer`) so gradient accumulation over
  micro-batches and data-parallel processes reproduces the gradient of the whole mini-batch exactly,
  in every aggregation mode (verl divides each micro-batch by its own token or sequence count).
- Sequences with an empty mask are left out of the `seq-mean-*` aggregations (verl yields NaN there).
- `overlong_penalty` is clamped at `-penalty_factor` past `max_len`, as in the DAPO paper (eq. 13).
- `warmup_lr` gives training step 0 the lr `lr / warmup_steps`, not 0 (verl and HF start at 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlep.common.types import Group, Trajectory

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KlEstimator = Literal["k1", "k2", "k3"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# verl clamps the log-ratio before exp() so one wildly off-policy token cannot overflow the ratio.
LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage of each trajectory within its group (RLEP eq. 1/5).

    A group is every trajectory sharing a `group_ids` value: fresh and replayed responses to one
    question alike, so replayed successes raise the baseline the fresh ones are compared against.

    Args:
        rewards: `[N]` float, one scalar reward per trajectory.
        group_ids: `[N]` long, group membership (any integer values, need not be contiguous).
        eps: added to the standard deviation.

    Returns:
        `[N]` float: `(r - mean_g) / (std_g + eps)` with the unbiased std of the group; a group of
        one uses mean 0 and std 1, as verl does. Groups whose rewards are all equal get 0.

    Raises:
        NonFiniteError: a reward is NaN or infinite (one such reward would make its whole group NaN),
            or an advantage came out non-finite; the message gives the first offending index.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be 1-D of one length, got {rewards.shape}, {group_ids.shape}")
    if rewards.numel() == 0:
        return rewards.clone()
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    _check_finite(rewards.to(out_dtype), group_ids, "reward")
    # Statistics in float64: squares of large float32 rewards would overflow to inf and zero the group.
    rewards = rewards.to(torch.float64)
    _, group_index = torch.unique(group_ids, return_inverse=True)  # [N] in 0..K-1
    num_groups = int(group_index.max()) + 1
    counts = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    counts.scatter_add_(0, group_index, torch.ones_like(rewards))
    sums = torch.zeros_like(counts).scatter_add_(0, group_index, rewards)
    means = sums / counts  # [K]
    centred = rewards - means[group_index]
    sq_sums = torch.zeros_like(counts).scatter_add_(0, group_index, centred * centred)
    stds = torch.sqrt(sq_sums / (counts - 1).clamp(min=1))  # unbiased, like torch.std
    singleton = counts[group_index] == 1
    mean = torch.where(singleton, torch.zeros_like(rewards), means[group_index])
    std = torch.where(singleton, torch.ones_like(rewards), stds[group_index])
    advantages = ((rewards - mean) / (std + eps)).to(out_dtype)
    _check_finite(advantages, group_ids, "advantage")
    return advantages


class NonFiniteError(ValueError):
    """A reward or an advantage is NaN or infinite: training on it would poison the whole update.

    `index` is the first offending position, so a caller can name the trajectory behind it.
    """

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def _check_finite(values: Tensor, group_ids: Tensor, what: str) -> None:
    bad = (~torch.isfinite(values)).nonzero().flatten()
    if bad.numel():
        first = int(bad[0])
        raise NonFiniteError(
            f"{bad.numel()} non-finite {what}(s); the first, at index {first} (group id {int(group_ids[first])}), "
            f"is {float(values[first])}: every {what} must be a finite number",
            first,
        )


def _masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return (values * mask).sum() if dim is None else (values * mask).sum(dim=dim)


def _safe_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask` is set; 0 (not NaN) when nothing is set."""
    return _masked_sum(values, mask) / mask.sum().clamp(min=1)


def aggregate_loss(per_token: Tensor, loss_mask: Tensor, agg: LossAgg, normalizer: float | None = None) -> Tensor:
    """Reduces a `[B, T]` per-token loss to a scalar.

    - `token-mean`: sum over every unmasked token of the batch / number of such tokens (DAPO).
    - `seq-mean-token-mean`: mean over sequences of each sequence's token mean (GRPO).
    - `seq-mean-token-sum`: mean over sequences of each sequence's token sum (Dr. GRPO style).

    `normalizer`, when given, replaces the denominator (the token count for `token-mean`, the number
    of non-empty sequences otherwise). Pass `mini_batch_normalizer` of the whole mini-batch to every
    micro-batch and the accumulated gradient equals the gradient of the mini-batch in one piece.
    """
    mask = loss_mask.to(per_token.dtype)
    if agg == "token-mean":
        denom = mask.sum().clamp(min=1) if normalizer is None else normalizer
        return _masked_sum(per_token, mask) / denom
    tokens_per_seq = mask.sum(dim=-1)  # [B]
    seq_sums = _masked_sum(per_token, mask, dim=-1)  # [B]
    if agg == "seq-mean-token-mean":
        seq_values = seq_sums / tokens_per_seq.clamp(min=1)
    elif agg == "seq-mean-token-sum":
        seq_values = seq_sums
    else:
        raise ValueError(f"agg must be one of {LOSS_AGGREGATIONS}, got {agg!r}")
    non_empty = (tokens_per_seq > 0).to(per_token.dtype)
    denom = non_empty.sum().clamp(min=1) if normalizer is None else normalizer
    return (seq_values * non_empty).sum() / denom


def mini_batch_normalizer(loss_mask: Tensor, agg: LossAgg, world_size: int = 1) -> float:
    """The `normalizer` each process passes to `policy_loss` for its micro-batches of one mini-batch.

    The mini-batch's own denominator in `aggregate_loss` (its unmasked token count for `token-mean`,
    its number of non-empty sequences for `seq-mean-*`), divided by `world_size`: every process
    divides its share of the loss numerator by it, and data parallelism averages the processes'
    gradients, so the sum over micro-batches and the mean over processes is the gradient of the whole
    mini-batch in one piece.

    Args:
        loss_mask: `[B, T]` the loss mask of the WHOLE mini-batch (every process's rows).
        agg: the aggregation mode of the loss.
        world_size: data-parallel processes sharing the mini-batch.

    Returns:
        A positive float (a mini-batch with nothing to train counts as 1, as `aggregate_loss` does).
    """
    if agg == "token-mean":
        count = loss_mask.sum()
    elif agg in LOSS_AGGREGATIONS:
        count = (loss_mask.sum(dim=-1) > 0).sum()
    else:
        raise ValueError(f"agg must be one of {LOSS_AGGREGATIONS}, got {agg!r}")
    return max(float(count.item()), 1.0) / world_size


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KlEstimator) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi (Schulman, "Approximating KL divergence").

    With d = log pi - log pi_ref: `k1` = d (unbiased, can be negative), `k2` = d^2 / 2 (biased, low variance; its
    gradient is the one of the true KL), `k3` = exp(-d) - 1 + d (unbiased, non-negative, low variance; GRPO's).
    d is clamped to +-LOG_RATIO_CLAMP as the PPO ratio is. The gradient flows through `logprobs` only.

    Args:
        logprobs: `[B, T]` the policy's logprobs of the sampled tokens.
        ref_logprobs: `[B, T]` the reference policy's logprobs of the same tokens.
        estimator: `k1`, `k2` or `k3`.

    Returns:
        `[B, T]` per-token estimates.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs and ref_logprobs must share a shape, got {tuple(logprobs.shape)}, "
                         f"{tuple(ref_logprobs.shape)}")  # fmt: skip
    d = torch.clamp(logprobs - ref_logprobs.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"estimator must be k1, k2 or k3, got {estimator!r}")


@dataclass(frozen=True)
class LossSettings:
    """How `policy_loss` turns per-token ratios into one loss: the run's fixed choices, DAPO's by default.

    `clip_low` / `clip_high`: the ratio is clipped to `[1 - clip_low, 1 + clip_high]` (DAPO's clip-higher).
    `clip_c`: dual-clip bound; for negative advantages the loss is capped at `-A * clip_c` (> 1).
    `agg`: how per-token losses are reduced (`aggregate_loss`).
    `kl_coef` / `kl_estimator`: with `kl_coef` > 0 each token's loss gains `kl_coef * kl_estimate(...)`.
    `entropy_coef`: with > 0 each token's loss loses `entropy_coef * entropy` (an entropy bonus).
    With both coefficients 0 (the default) the loss is exactly DAPO's: nothing is added.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 10.0
    agg: LossAgg = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.clip_c <= 1.0:
            raise ValueError(f"clip_c must be > 1 for dual-clip, got {self.clip_c}")
        if self.agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"agg must be one of {LOSS_AGGREGATIONS}, got {self.agg!r}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    settings: LossSettings = LossSettings(),  # noqa: B008 (frozen: one shared default is safe)
    *,
    normalizer: float | None = None,
    token_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO's clipped policy-gradient loss with dual-clip (RLEP eq. 3/4, verl `compute_policy_loss`).

    Args:
        logprobs: `[B, T]` log-probabilities of the response tokens under the policy being trained.
        old_logprobs: `[B, T]` the same under the policy before this update (no gradient).
        advantages: `[B]` one advantage per sequence, broadcast over its tokens.
        loss_mask: `[B, T]` 1 for response tokens that count, 0 for padding.
        settings: clip bounds, aggregation, KL and entropy coefficients (`LossSettings`; default DAPO's).
        normalizer: denominator override for gradient accumulation (see `aggregate_loss`).
        token_weights: `[B, T]` optional constant weights of each token's loss (no gradient), e.g. a behavior
            correction's (`mismatch.correction_weights`); None = 1 everywhere.
        ref_logprobs: `[B, T]` a reference policy's logprobs; with `settings.kl_coef` > 0 each token's loss gains
            `kl_coef * kl_estimate(logprobs, ref_logprobs, kl_estimator)` (not re-weighted by `token_weights`).
        entropy: `[B, T]` the policy's entropy at each position, with its gradient; needed with
            `settings.entropy_coef` > 0.

    Returns:
        `(loss, metrics)`: a scalar loss to minimise and detached 0-dim tensors `clip_fraction` (tokens where the
        ratio clip is active), `clip_fraction_dual` (tokens where the dual clip is active),
        `approx_kl` (mean of old - new logprob) and `ratio_mean`, all over unmasked tokens; with a KL term also
        `kl_ref` (the mean estimate).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape or logprobs.ndim != 2:
        raise ValueError(
            f"logprobs, old_logprobs, loss_mask must share a [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")
    mask = loss_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [B, T]

    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - settings.clip_low, 1.0 + settings.clip_high)
    ppo_loss = torch.maximum(unclipped, clipped)  # pessimistic bound of PPO
    dual_bound = -adv * settings.clip_c
    dual_loss = torch.minimum(dual_bound, ppo_loss)  # caps the loss of very large ratios when A < 0
    per_token = torch.where(adv < 0, dual_loss, ppo_loss)
    if token_weights is not None:
        if token_weights.shape != logprobs.shape:
            raise ValueError(f"token_weights must be {tuple(logprobs.shape)}, got {tuple(token_weights.shape)}")
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    kl = None
    if settings.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_estimate(logprobs, ref_logprobs, settings.kl_estimator)
        per_token = per_token + settings.kl_coef * kl
    if settings.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy")
        per_token = per_token - settings.entropy_coef * entropy

    loss = aggregate_loss(per_token, loss_mask, settings.agg, normalizer)
    with torch.no_grad():  # 0-dim tensors on the loss's device: reading them is the caller's (one sync per read)
        metrics = {
            "clip_fraction": _safe_mean((clipped > unclipped).to(mask.dtype), mask),
            "clip_fraction_dual": _safe_mean(((ppo_loss > dual_bound) & (adv < 0)).to(mask.dtype), mask),
            "approx_kl": _safe_mean(-log_ratio, mask),
            "ratio_mean": _safe_mean(ratio, mask),
        }
        if kl is not None:
            metrics["kl_ref"] = _safe_mean(kl, mask)
    return loss, metrics


def overlong_penalty(response_lengths: Tensor, max_len: int, buffer_len: int, penalty_factor: float) -> Tensor:
    """DAPO's soft overlong punishment, added to the task reward.

    Args:
        response_lengths: `[N]` response lengths in tokens.
        max_len: maximum response length (the generation limit).
        buffer_len: width of the linear penalty zone ending at `max_len`.
        penalty_factor: penalty reached at `max_len`.

    Returns:
        `[N]` float: 0 for lengths up to `max_len - buffer_len`, then falling linearly to
        `-penalty_factor` at `max_len`, and `-penalty_factor` beyond it.
    """
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"need 0 <= buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    lengths = response_lengths.to(torch.float32)
    expected = max_len - buffer_len
    if buffer_len == 0:
        return torch.where(lengths > max_len, -penalty_factor, 0.0).to(torch.float32)
    excess = (lengths - expected) / buffer_len
    return (-excess.clamp(min=0.0, max=1.0) * penalty_factor).to(torch.float32)


def warmup_lr(training_step: int, lr: float, warmup_steps: int) -> float:
    """Learning rate of 0-based `training_step`: linear warm-up over `warmup_steps` training steps, then `lr`.

    Counted in training steps (one rollout batch, however many optimizer steps its mini-batches
    make), as verl calls its scheduler once per training step. Step k gets `lr * min(1, (k+1) /
    warmup_steps)`, so no step runs at lr 0 (verl's and HF's first step does).
    """
    if warmup_steps <= 0:
        return lr
    return lr * min(1.0, (training_step + 1) / warmup_steps)


def flatten_groups(groups: Sequence[Group]) -> tuple[list[Trajectory], Tensor, Tensor]:
    """Flattens groups for `group_advantages`.

    Returns:
        `(trajectories, rewards [N] float32, group_ids [N] long)` in group order.
    """
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    return trajectories, rewards, group_ids
