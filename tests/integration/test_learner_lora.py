"""LoRA on the DeepSpeed learner (Ray actors, gloo): an update moves only the adapted weights, every weight that
leaves the learner is the merged plain model, the KL reference is the base with the adapter off, and an
adapter-only checkpoint resumes bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from rlep.services.learner.batch import ExperienceBatch
from rlep.services.learner.config import LORA_TARGETS
from tests.learner_batches import synthetic_batch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LR = 1e-3


def start_policy(model_dir, lora=True, kl_coef=0.0, stage=2, processes=1):
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.ray_policy import RayPolicy

    config = TrainConfig.model_validate(
        {
            "seed": 11,
            "algorithm": {"questions_per_step": 4, "mini_batch_questions": 2, "kl_coef": kl_coef},
            "optim": {"lr": LR, "warmup_steps": 0, "weight_decay": 0.0, "micro_batch_size": 3},
            "deepspeed": {"zero_stage": stage, "num_processes": processes},
            "lora": {"rank": 4, "alpha": 8.0} if lora else {},
            "local": {"learner_cpus": 0.5},
        }
    )
    return RayPolicy(model_dir, config)


@pytest.fixture(scope="module")
def model_dir():
    from rlep.common.tiny_model import cached_model

    return cached_model("tiny")


@pytest.fixture(scope="module")
def plain(model_dir) -> dict[str, torch.Tensor]:
    """The starting checkpoint's tensors, tied head left out (as pushes leave it out)."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    return {k: v for k, v in state.items() if k != "lm_head.weight"}


@pytest.fixture(scope="module")
def batch():
    return synthetic_batch(vocab=100, pad_id=0)


def adapted(name: str) -> bool:
    return name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in LORA_TARGETS


def test_an_update_moves_only_the_adapted_weights_and_everything_leaves_merged(adapter_runs, plain):
    """ZeRO-2, one process: the first update of its adapter run, with an HF export after it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    initial, stats, final, manifest, hf = adapter_runs["zero2"].first
    # B starts at 0: the first push is the starting checkpoint, under its own names and in its order.
    assert list(initial) == manifest == list(plain)
    assert all(torch.equal(initial[k], plain[k]) for k in plain)
    moved = {k for k in final if not torch.equal(final[k], initial[k])}
    assert moved == {k for k in final if adapted(k)}  # biases, norms, embeddings stay the base's
    assert stats["optimizer_steps"] == 2.0
    # The export is a plain HF checkpoint: no adapter tensors, loadable without PEFT, equal to what is pushed.
    exported = load_file(str(hf / "model.safetensors"))
    assert not [k for k in exported if "lora" in k or "base_layer" in k]
    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], final[k]) for k in final)


class Update(NamedTuple):
    """One LoRA update from the base, as the weights leave the learner (merged)."""

    initial: dict[str, torch.Tensor]  # before it
    stats: dict
    final: dict[str, torch.Tensor]  # after it
    manifest: list[str]  # the push manifest's names
    hf: Path | None  # the HF checkpoint exported after it, if asked for


class AdapterRun(NamedTuple):
    """One LoRA policy with a KL term, started from the base: two updates, a checkpoint, one more update."""

    stage: int
    processes: int
    first: Update  # the first of the two updates
    before: torch.Tensor  # reference logprobs before any update
    old: torch.Tensor  # the policy's logprobs before any update
    after: torch.Tensor  # reference logprobs after two updates
    now: torch.Tensor  # the policy's logprobs after two updates
    stats: dict  # the second update's statistics
    checkpoints: Path  # step_2: saved after the two updates
    with_old: ExperienceBatch  # the batch of the update that followed the checkpoint
    uninterrupted: tuple[dict, dict[str, torch.Tensor]]  # that update's statistics and the weights it left


ADAPTER_CASES = {"zero2": (2, 1), "zero3-x2": (3, 2)}


def update_from_the_base(policy, model_dir, batch, reference: torch.Tensor, hf_dir: Path | None = None) -> Update:
    """The first update (two mini-batches, the KL term against `reference`), with what leaves the learner."""
    initial = policy.state_dict()
    manifest = [name for name, _ in policy.weight_manifest()]
    with_old = batch.with_old_logprobs(policy.logprobs(batch)).with_ref_logprobs(reference)
    stats = policy.update(with_old, rows_per_mini_batch=batch.size // 2)
    final = policy.state_dict()
    if hf_dir is not None:
        policy.save_hf(hf_dir, model_dir)
    return Update(initial, stats, final, manifest, hf_dir)


def adapter_run(model_dir, batch, stage: int, processes: int, folder: Path) -> AdapterRun:
    checkpoints = folder / "checkpoints"
    policy = start_policy(model_dir, kl_coef=0.1, stage=stage, processes=processes)
    try:
        before = policy.reference_logprobs(batch)
        old = policy.logprobs(batch)
        first = update_from_the_base(policy, model_dir, batch, before, folder / "hf")
        with_old = batch.with_old_logprobs(policy.logprobs(batch)).with_ref_logprobs(before)
        stats = policy.update(with_old, rows_per_mini_batch=batch.size // 2)
        after, now = policy.reference_logprobs(batch), policy.logprobs(batch)
        policy.save_checkpoint(checkpoints, "step_2", policy.rng_state())
        uninterrupted = policy.update(with_old, rows_per_mini_batch=batch.size // 2), policy.state_dict()
    finally:
        policy.close()
    return AdapterRun(stage, processes, first, before, old, after, now, stats, checkpoints, with_old, uninterrupted)


@pytest.fixture(scope="module")
def adapter_runs(ray_local, model_dir, batch, tmp_path_factory) -> dict[str, AdapterRun]:
    """One policy per ZeRO case (each start costs seconds) for four tests: the first update's merged weights and its
    one- against two-process comparison, the KL reference, then the checkpoint."""
    return {
        name: adapter_run(model_dir, batch, stage, processes, tmp_path_factory.mktemp(name))
        for name, (stage, processes) in ADAPTER_CASES.items()
    }


@pytest.mark.parametrize("case", ADAPTER_CASES)
def test_the_kl_reference_is_the_base_with_the_adapter_off(adapter_runs, case):
    run = adapter_runs[case]
    assert torch.equal(run.before, run.old)  # B = 0: the policy starts as the base
    assert torch.equal(run.after, run.before)  # the updates moved the policy, never its reference
    assert (run.now - run.old).abs().max() > 1e-3 and run.stats["kl_ref"] > 0


@pytest.fixture(scope="module")
def full_checkpoint(ray_local, model_dir, tmp_path_factory) -> Path:
    """A full fine-tuning run's checkpoint (`step_0` in the returned folder), which no LoRA run may load."""
    folder = tmp_path_factory.mktemp("full")
    full = start_policy(model_dir, lora=False)
    try:
        full.save_checkpoint(folder, "step_0", full.rng_state())
    finally:
        full.close()
    return folder


@pytest.mark.parametrize("case", ADAPTER_CASES)
def test_an_adapter_checkpoint_resumes_exactly_and_a_full_one_is_refused(
    adapter_runs, case, model_dir, full_checkpoint
):
    """The resumed policy lands where the uninterrupted run did. Under ZeRO-2 it first refuses a full fine-tuning
    checkpoint (the adapter's load names what is missing), and that refusal touches nothing. (Under ZeRO-3 over two
    processes DeepSpeed fails earlier on that one-process checkpoint's files, with an assertion of its own; `rlep
    train --resume` and the trainer's resume refuse either first, from the checkpoint's info.)"""
    run = adapter_runs[case]
    for states in (run.checkpoints / "step_2").glob("*mp_rank_00_model_states.pt"):  # one per process (ZeRO-3)
        saved = torch.load(states, weights_only=False)["module"]
        assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)  # the frozen base is not saved
    saved_bytes = sum(f.stat().st_size for f in (run.checkpoints / "step_2").iterdir())
    assert saved_bytes < 0.5 * sum(t.numel() * t.element_size() for t in run.uninterrupted[1].values())

    resumed = start_policy(model_dir, kl_coef=0.1, stage=run.stage, processes=run.processes)
    try:
        if case == "zero2":
            with pytest.raises(Exception, match="not this run's LoRA adapter"):
                resumed.load_checkpoint(full_checkpoint, "step_0")
        resumed.load_checkpoint(run.checkpoints, "step_2")
        after = resumed.update(run.with_old, rows_per_mini_batch=run.with_old.size // 2), resumed.state_dict()
    finally:
        resumed.close()
    assert after[0] == run.uninterrupted[0]
    assert after[1].keys() == run.uninterrupted[1].keys()
    assert all(torch.equal(after[1][k], run.uninterrupted[1][k]) for k in after[1])


@pytest.mark.parametrize("case", ["zero2-x2", "zero3-x2"])
def test_lora_over_two_processes_makes_the_one_process_update(adapter_runs, model_dir, batch, case):
    """Two learner processes (rows split, adapter gradients all-reduced over gloo; under ZeRO-3 the frozen base and
    the adapters partitioned too, gathered a layer at a time for the merge) move the merged weights as one process
    does (what rank 0 pushes), and only the adapted ones. ZeRO-3's is the first update of its adapter run."""
    one = adapter_runs["zero2"].first
    if case == "zero3-x2":
        two = adapter_runs["zero3-x2"].first
    else:
        policy = start_policy(model_dir, kl_coef=0.1, stage=2, processes=2)
        try:
            two = update_from_the_base(policy, model_dir, batch, policy.reference_logprobs(batch))
        finally:
            policy.close()
    initial = one.initial
    assert two.initial.keys() == initial.keys() and all(torch.equal(two.initial[k], initial[k]) for k in initial)
    one_delta = {k: one.final[k] - initial[k] for k in one.final}
    two_delta = {k: two.final[k] - initial[k] for k in two.final}
    assert {k for k, d in two_delta.items() if d.abs().max() > 0} == {k for k in two.final if adapted(k)}
    difference = sum(float((one_delta[k] - two_delta[k]).pow(2).sum()) for k in one.final) ** 0.5
    assert difference < 1e-2 * sum(float(d.pow(2).sum()) for d in one_delta.values()) ** 0.5
    assert two.stats["loss"] == pytest.approx(one.stats["loss"], rel=1e-4, abs=1e-6)
    assert two.stats["optimizer_steps"] == one.stats["optimizer_steps"] == 2.0
