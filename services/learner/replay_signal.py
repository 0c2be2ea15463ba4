"""How much a step's replayed rows could teach the policy (issue 29): the figures that say why replay speeds a run up,
or does not.

RLEP's replayed successes change an update only through their advantages, which are normalised over the mixed
group of G fresh + M replayed rows. They matter most in a group whose fresh rows all failed: plain GRPO gives such
a group no gradient at all, replay gives it one. And they teach little when the policy already samples them itself.
Each RLEP step's record carries (`replay_*`; absent from a step without replayed rows):

- `advantage_share`: the replayed rows' share of the step's advantage mass, sum over rows of |A| x response tokens
  (the token-mean loss weighs a row's gradient by both): 0 when replay changed nothing, 1 when it was all there was;
- `signal_groups`: groups whose fresh rows all scored alike (no gradient without replay) that replay gave a
  non-zero advantage, i.e. the questions replay rescued this step;
- `logprob_mean`: mean per-token logprob of the replayed responses under the policy before the update (raw
  distribution, temperature 1, as the learner scores);
- `sequence_prob_mean`: mean over replayed rows of exp(sum of its logprobs), the chance the policy samples that
  exact answer itself: near 1, the replayed rows repeat what its own samples already show.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ReplaySignal:
    advantage_share: float
    signal_groups: int
    logprob_mean: float
    sequence_prob_mean: float

    def figures(self) -> dict[str, float | int]:
        """The step record's `replay_<name>` values, by name (every field: a new one cannot be left out)."""
        return dataclasses.asdict(self)


def replay_signal(
    advantages: Tensor, rewards: Tensor, replayed: Tensor, group_index: Tensor, old_logprobs: Tensor, loss_mask: Tensor
) -> ReplaySignal | None:
    """The figures above for one step's batch: `advantages`, `rewards`, `replayed`, `group_index` are `[N]`,
    `old_logprobs` and `loss_mask` `[N, L-1]`. None when no row is replayed."""
    if not bool(replayed.any()):
        return None
    tokens = loss_mask.sum(dim=1)
    mass = advantages.abs() * tokens
    total = float(mass.sum())
    share = float(mass[replayed].sum()) / total if total > 0 else 0.0
    signal_groups = 0
    for group in group_index[replayed].unique():
        rows = group_index == group
        fresh = rewards[rows & ~replayed]
        alike = fresh.numel() == 0 or bool((fresh == fresh[0]).all())
        if alike and bool((advantages[rows & replayed] != 0).any()):
            signal_groups += 1
    sums = (old_logprobs * loss_mask)[replayed].sum(dim=1)
    replayed_tokens = tokens[replayed]
    logprob_mean = float(sums.sum() / replayed_tokens.sum().clamp(min=1))
    return ReplaySignal(
        advantage_share=share,
        signal_groups=signal_groups,
        logprob_mean=logprob_mean,
        sequence_prob_mean=float(torch.exp(sums).mean()),
    )
