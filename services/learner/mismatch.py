"""The gap between the rollout engine's policy and the learner's, measured on the tokens the engine sampled (issue 33).

The two sides compute the same policy with different kernels and often in different dtypes (vLLM's `dtype: auto`
runs a float32 checkpoint in bfloat16 while the learner trains in float32), and with `max_staleness` > 0 on
different weights too. The PPO ratio starts from the learner's old logprobs, so a sample the engine drew where the
learner disagrees is trained on as if the learner had drawn it: the train/inference mismatch behind collapses
reported in verl's and OpenRLHF's issues. Each step's record carries how large it is (`rollout_mismatch_*`).

Like with like: both sides' logprobs are of the *raw* (untempered, unfiltered) model distribution. The learner
scores at temperature 1, and the rollout engine returns vLLM's `raw_logprobs` (`logprobs_mode`, its default), so
temperature and top-p change which tokens are sampled, not what is compared. Per token, with
r = pi_learner / pi_rollout = exp(old_logprob - sampler_logprob):

- `kl`: mean of k3 = (r - 1) - log r over the sampled tokens, Schulman's unbiased, non-negative estimator of
  KL(pi_rollout || pi_learner), as the tokens are drawn from pi_rollout;
- `ratio_p99`, `ratio_max`: the 99th percentile (nearest rank) and the largest r;
- `outside_cap`: the fraction of tokens whose r leaves [1/cap, cap] (`behavior_weight_cap`), the tokens a masked
  importance weight would drop and a truncated one cap.

Replayed rows have no sampler (they were stored, not sampled by these weights) and are not part of it.

The corrections of it live here too (`behavior_correction`): one function per mode (`truncated_is`,
`seq_truncated_is`, `masked_is`, `seq_masked_is`), chosen by `correction_weights` from `CORRECTION_WEIGHTS`; their
per-token weights go to `policy_loss` as `token_weights`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from rlep.services.learner.algorithm import LOG_RATIO_CLAMP


@dataclass(frozen=True)
class Mismatch:
    tokens: int
    """Sampled tokens compared (fresh rows' response tokens)."""
    kl: float
    ratio_p99: float
    ratio_max: float
    outside_cap: float

    def figures(self) -> dict[str, float]:
        """The step record's `rollout_mismatch_<name>` values, by name."""
        return {
            "kl": self.kl,
            "ratio_p99": self.ratio_p99,
            "ratio_max": self.ratio_max,
            "outside_cap": self.outside_cap,
        }


def rollout_mismatch(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float) -> Mismatch | None:
    """The mismatch over the tokens where `mask` is set and the sampler gave a logprob.

    Args:
        old_logprobs: `[B, T]` the learner's logprobs of the tokens, under the weights the update starts from.
        sampler_logprobs: `[B, T]` the rollout engine's logprobs of the same tokens; NaN where there is none
            (replayed rows, prompt positions, padding).
        mask: `[B, T]` the tokens trained on (`loss_mask`).
        cap: the band [1/cap, cap] of `outside_cap` (>= 1).

    Returns:
        The figures, or None when no token has both logprobs.
    """
    if not (old_logprobs.shape == sampler_logprobs.shape == mask.shape):
        raise ValueError(
            f"old_logprobs, sampler_logprobs and mask must share a shape, got {tuple(old_logprobs.shape)}, "
            f"{tuple(sampler_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    compared = mask.bool() & ~torch.isnan(sampler_logprobs)
    if not compared.any():
        return None
    log_ratio = (old_logprobs.detach().double() - sampler_logprobs.double())[compared]
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    k3 = (ratio - 1.0) - log_ratio
    outside = log_ratio.abs() > math.log(cap)
    return Mismatch(
        tokens=int(compared.sum()),
        kl=float(k3.mean()),
        # Nearest rank: torch.quantile refuses inputs over 2**24 values, a paper-sized step's token count.
        ratio_p99=float(ratio.kthvalue(max(1, math.ceil(0.99 * ratio.numel()))).values),
        ratio_max=float(ratio.max()),
        outside_cap=float(outside.double().mean()),
    )


Correction = Literal["truncated_is", "seq_truncated_is", "masked_is", "seq_masked_is"]
CORRECTIONS: tuple[Correction, ...] = get_args(Correction)


def _sampled_log_ratio(old_logprobs: Tensor, sampler_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """`(sampled [B, T] bool, log r [B, T])`: where the sampler gave a logprob, and log(pi_learner / pi_rollout)
    there, clamped like the PPO ratio (0 elsewhere)."""
    sampled = ~torch.isnan(sampler_logprobs)
    log_ratio = torch.where(sampled, old_logprobs.detach() - sampler_logprobs, 0.0).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    return sampled, log_ratio


def truncated_is(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """TIS: each token's ratio pi_old / pi_sampler, truncated at `cap`, no lower bound (AReaL's decoupled PPO
    objective with a truncated weight): it re-weights samples drawn by other weights than the update's old policy
    (a stale replica, a sampler whose kernels differ) towards the old policy the PPO ratio starts from."""
    log_weight = torch.clamp(old_logprobs.detach() - sampler_logprobs, max=math.log(cap))
    return torch.where(torch.isnan(sampler_logprobs), 1.0, torch.exp(log_weight)).to(old_logprobs.dtype)


def seq_truncated_is(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """The sequence's ratio (the product of its sampled tokens'), truncated at `cap`, on all its tokens."""
    sampled, log_ratio = _sampled_log_ratio(old_logprobs, sampler_logprobs)
    per_row = log_ratio.sum(dim=1, keepdim=True)  # log of the sequence's ratio
    weights = per_row.clamp(max=math.log(cap)).exp().expand_as(log_ratio)
    return torch.where(sampled, weights, 1.0).to(old_logprobs.dtype)


def masked_is(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """IcePop: 1 for a token whose ratio lies in [1/cap, cap], 0 (left out of the gradient) otherwise."""
    sampled, log_ratio = _sampled_log_ratio(old_logprobs, sampler_logprobs)
    weights = (log_ratio.abs() <= math.log(cap)).to(log_ratio.dtype)
    return torch.where(sampled, weights, 1.0).to(old_logprobs.dtype)


def seq_masked_is(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """1 for every token of a sequence whose geometric-mean ratio (over its sampled tokens) lies in [1/cap, cap],
    else 0."""
    sampled, log_ratio = _sampled_log_ratio(old_logprobs, sampler_logprobs)
    per_row = log_ratio.sum(dim=1, keepdim=True)  # log of the sequence's ratio
    geometric = per_row / sampled.sum(dim=1, keepdim=True).clamp(min=1)
    weights = (geometric.abs() <= math.log(cap)).to(log_ratio.dtype).expand_as(log_ratio)
    return torch.where(sampled, weights, 1.0).to(old_logprobs.dtype)


CORRECTION_WEIGHTS: dict[Correction, Callable[[Tensor, Tensor, float], Tensor]] = {
    "truncated_is": truncated_is,
    "seq_truncated_is": seq_truncated_is,
    "masked_is": masked_is,
    "seq_masked_is": seq_masked_is,
}


def correction_weights(mode: Correction, old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """Importance weights pi_learner / pi_rollout that correct the mismatch, per token (`behavior_correction`):
    `mode`'s function of `CORRECTION_WEIGHTS` (`truncated_is`, `seq_truncated_is`, `masked_is`, `seq_masked_is`).

    Args:
        mode: one of `CORRECTIONS`.
        old_logprobs: `[B, T]` the learner's logprobs under the weights the update starts from.
        sampler_logprobs: `[B, T]` the rollout engine's; NaN where there is none. Those tokens, and every token of a
            row with none (a replayed row: it has no sampler), get weight 1.
        cap: the bound (>= 1).

    Returns:
        `[B, T]` weights in `old_logprobs`' dtype, with no gradient.
    """
    if mode not in CORRECTION_WEIGHTS:
        raise ValueError(f"unknown correction {mode!r}; expected one of {CORRECTIONS}")
    if old_logprobs.shape != sampler_logprobs.shape:
        raise ValueError(
            f"old_logprobs and sampler_logprobs must share a shape, got "
            f"{tuple(old_logprobs.shape)}, {tuple(sampler_logprobs.shape)}"
        )
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    return CORRECTION_WEIGHTS[mode](old_logprobs, sampler_logprobs, cap)


def correction_figures(
    mode: Correction, old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float
) -> dict:
    """What a correction did to a step's batch, for its record (`rollout_correction_<name>`): the mean weight and the
    fraction of weight-0 tokens over the sampled tokens trained on, and the rows left at weight 1 for having no
    sampler (replayed rows)."""
    weights = correction_weights(mode, old_logprobs, sampler_logprobs, cap)
    sampled = mask.bool() & ~torch.isnan(sampler_logprobs)
    unweighted_rows = int((mask.bool().any(dim=1) & ~sampled.any(dim=1)).sum())
    if not sampled.any():
        return {"weight_mean": None, "masked": None, "unweighted_rows": unweighted_rows}
    chosen = weights[sampled].double()
    return {
        "weight_mean": float(chosen.mean()),
        "masked": float((chosen == 0).double().mean()),
        "unweighted_rows": unweighted_rows,
    }
