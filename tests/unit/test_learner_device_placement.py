"""Nothing that runs on the learner's device makes a tensor of its own on the CPU.

PyTorch's `meta` device stands in for CUDA here: a CPU tensor meeting a meta tensor raises the same "not on the
expected device" error as one meeting a CUDA tensor. Every function the update runs on the engine's device (the
batch move, the scoring model, the chunked scores, the loss, the behaviour weights) runs with meta inputs and
must return meta outputs. What runs on the host by design (building the batch, planning micro-batches, counting
tokens) stays there. The HF decoder itself cannot run on meta (its SDPA mask reads a value back with
`.item()`); it and the whole update on CUDA are tests/gpu/.
"""

from __future__ import annotations

import pytest
import torch

from rlep.common.types import Group, Source, Trajectory
from rlep.services.learner.algorithm import LossSettings, aggregate_loss, policy_loss
from rlep.services.learner.batch import build_batch, token_scores
from rlep.services.learner.mismatch import correction_weights

META = torch.device("meta")


def test_a_cpu_tensor_meeting_a_meta_tensor_raises_as_on_cuda():
    with pytest.raises(RuntimeError, match="device"):
        torch.zeros(3) + torch.zeros(3, device=META)


def test_the_batch_moves_whole():
    groups = [
        Group(
            "q",
            "1",
            [
                Trajectory(
                    "q", "a", 1.0, prompt_token_ids=(1, 2), response_token_ids=(3, 4), behavior_logprobs=(-1, -2)
                ),
                Trajectory("q", "b", 0.0, source=Source.REPLAY, prompt_token_ids=(1,), response_token_ids=(5,)),
            ],
        )
    ]
    batch = build_batch(groups, pad_id=0, with_behavior=True)
    batch = batch.with_old_logprobs(torch.zeros_like(batch.loss_mask))
    moved = batch.to(META)
    assert all(t.device == META for t in vars(moved).values() if isinstance(t, torch.Tensor))
    assert batch.to(torch.device("cpu")) is batch


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_loss_and_its_statistics_stay_on_the_device(agg):
    shape = (3, 5)
    new = torch.zeros(shape, device=META, requires_grad=True)
    old, mask = torch.zeros(shape, device=META), torch.ones(shape, device=META)
    weights = correction_weights("truncated_is", old, torch.zeros(shape, device=META), cap=2.0)
    loss, stats = policy_loss(
        new, old, torch.ones(3, device=META), mask, LossSettings(agg=agg), normalizer=7.0, token_weights=weights
    )
    assert loss.device == META and weights.device == META
    assert all(v.device == META for v in stats.values())
    assert aggregate_loss(new, mask, agg).device == META


@pytest.mark.parametrize("grad", [True, False])
def test_chunked_scores_stay_on_the_device(grad):
    head = torch.nn.Linear(8, 50, bias=False, device=META)
    hidden = torch.zeros(2, 6, 8, device=META, requires_grad=grad)
    tokens = torch.zeros(2, 6, dtype=torch.long, device=META)
    with torch.set_grad_enabled(grad):
        logprobs, entropy = token_scores(hidden, head, tokens, chunk_positions=4)
    assert logprobs.device == META and entropy.device == META and logprobs.shape == (2, 5)
