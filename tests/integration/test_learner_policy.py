"""The DeepSpeed learner on Ray actors: one update is the same update whatever the ZeRO stage or process count.

Each case runs `RayPolicy` (DeepSpeed over gloo on CPU) on the same batch of mixed groups: old
logprobs, then two PPO mini-batches with DAPO's loss (AdamW, no warm-up), then the full weights.
With token-mean normalisation by the mini-batch's token count, splitting rows over processes and
micro-batches must not change the gradient, so every case must land on the reference's weights and
report the reference's statistics.
"""

from __future__ import annotations

import pytest
import torch

from rlep_common.types import Group, Source, Trajectory
from services.learner.batch import ExperienceBatch, build_batch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CASES = [(0, 1), (2, 2), (3, 2)]  # (ZeRO stage, processes); the first is the reference


def synthetic_batch(vocab: int, pad_id: int, seed: int = 0) -> ExperienceBatch:
    """4 questions x (3 fresh + 1 replayed) random responses of varied length, rewards +-1."""
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


def run_update(model_dir, batch: ExperienceBatch, stage: int, processes: int):
    from services.learner.config import TrainConfig
    from services.learner.launch import RayPolicy

    config = TrainConfig.model_validate(
        {
            "seed": 11,
            "algorithm": {"questions_per_step": 4, "mini_batch_questions": 2},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0, "micro_batch_size": 3},
            "deepspeed": {"zero_stage": stage, "num_processes": processes},
            "local": {"learner_cpus": 0.5},
        }
    )
    policy = RayPolicy(model_dir, config)
    try:
        initial = policy.state_dict()
        with_old = batch.with_old_logprobs(policy.logprobs(batch))
        stats = policy.update(with_old, rows_per_mini_batch=batch.size // 2)
        return initial, with_old.old_logprobs, stats, policy.state_dict()
    finally:
        policy.close()


@pytest.fixture(scope="module")
def updates(ray_local):
    from rlep_common.tiny_model import cached_model

    model_dir = cached_model("tiny")
    batch = synthetic_batch(vocab=100, pad_id=0)
    return {case: run_update(model_dir, batch, *case) for case in CASES}


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    return diff / sum(float(reference[k].pow(2).sum()) for k in reference) ** 0.5


@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: f"zero{c[0]}-x{c[1]}")
def test_update_does_not_depend_on_zero_stage_or_processes(updates, case):
    ref_initial, ref_old, ref_stats, ref_final = updates[CASES[0]]
    initial, old, stats, final = updates[case]
    assert all(torch.equal(initial[k], ref_initial[k]) for k in ref_initial)
    torch.testing.assert_close(old, ref_old, rtol=1e-5, atol=1e-5)
    ref_delta = {k: ref_final[k] - ref_initial[k] for k in ref_final}
    delta = {k: final[k] - initial[k] for k in final}
    # Adam's first steps move every weight with a gradient by ~lr; float32 sums in another order may
    # flip only weights whose gradient is ~0, so the two updates agree to well under 1%.
    assert _relative(delta, ref_delta, ref_delta) < 1e-2
    for key in ("loss", "entropy", "clip_fraction", "approx_kl"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-4, abs=1e-6), key
    assert stats["optimizer_steps"] == ref_stats["optimizer_steps"] == 2.0


def test_the_update_moves_every_trained_tensor_with_the_full_lr_from_step_one(updates):
    initial, _, stats, final = updates[CASES[0]]
    moved = {k for k in final if not torch.equal(final[k], initial[k])}
    assert moved == set(final)
    # No warm-up: the first of the two Adam steps already uses the full lr (~lr per weight per step).
    largest = max(float((final[k] - initial[k]).abs().max()) for k in final)
    assert 1.5e-3 < largest < 2.1e-3
    assert stats["lr"] == pytest.approx(1e-3)
