"""The DeepSpeed learner on Ray actors: one update is the same update whatever the ZeRO stage, process
count or gradient checkpointing; the lr warm-up counts training steps; saved checkpoints keep the tokenizer.

Each case runs `RayPolicy` (DeepSpeed over gloo on CPU) on the same batch of mixed groups: old
logprobs, then two PPO mini-batches with DAPO's loss (AdamW, no warm-up), then the full weights.
With token-mean normalisation by the mini-batch's token count, splitting rows over processes and
micro-batches must not change the gradient, so every case must land on the reference's weights and
report the reference's statistics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from rlep.services.learner.batch import ExperienceBatch
from tests.checkpoint_util import assert_same_tree, deepspeed_state
from tests.learner_batches import synthetic_batch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# (ZeRO stage, processes, gradient checkpointing, other settings); the first is the reference. The token budget
# (24 tokens: rows of 10-21 tokens run alone or in pairs) and PyTorch's fused AdamW under optimizer offload
# (passed through DeepSpeed's config) must not change the update either.
CASES = [
    (0, 1, False, {}),
    (2, 2, False, {}),
    (3, 2, False, {}),
    (3, 2, True, {}),
    (2, 2, False, {"optim": {"micro_batch_tokens": 24}}),
    (2, 1, False, {"deepspeed": {"offload_optimizer": True, "adam": "torch"}}),
]
LR = 1e-3


def case_id(case) -> str:
    stage, processes, checkpointing, extra = case
    keys = [k for section in extra.values() for k in section if k != "adam"]
    return f"zero{stage}-x{processes}" + ("-ckpt" if checkpointing else "") + "".join(f"-{k}" for k in keys)


def start_policy(
    model_dir, stage: int = 2, processes: int = 1, warmup_steps: int = 0, optim=None, algorithm=None, **deepspeed
):
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.ray_policy import RayPolicy

    config = TrainConfig.model_validate(
        {
            "seed": 11,
            "algorithm": {"questions_per_step": 4, "mini_batch_questions": 2} | (algorithm or {}),
            "optim": {"lr": LR, "warmup_steps": warmup_steps, "weight_decay": 0.0, "micro_batch_size": 3}
            | (optim or {}),
            "deepspeed": {"zero_stage": stage, "num_processes": processes, **deepspeed},
            "local": {"learner_cpus": 0.5},
        }
    )
    return RayPolicy(model_dir, config)


class Update(NamedTuple):
    initial: dict[str, torch.Tensor]
    old: torch.Tensor  # the old logprobs
    stats: dict[str, float]
    final: dict[str, torch.Tensor]
    seen: Any = None  # what the case's `before_update` observed on the started policy
    after: Any = None  # what its `after_update` did with the policy once the update's figures were taken


def run_update(
    model_dir, batch: ExperienceBatch, case: tuple, hf_dir: Path | None = None, before_update=None, after_update=None
) -> Update:
    """One case's update. `before_update(policy)` first looks at the started policy (without changing its weights or
    optimizer state), `after_update(policy)` may go on training it once the update's figures are taken: a case whose
    engine another test needs is started once, for both."""
    stage, processes, checkpointing, extra = case
    deepspeed = {"gradient_checkpointing": checkpointing, **extra.get("deepspeed", {})}
    policy = start_policy(model_dir, stage, processes, optim=extra.get("optim"), **deepspeed)
    try:
        seen = before_update(policy) if before_update is not None else None
        initial = policy.state_dict()
        with_old = batch.with_old_logprobs(policy.logprobs(batch))
        stats = policy.update(with_old, rows_per_mini_batch=batch.size // 2)
        if hf_dir is not None:
            policy.save_hf(hf_dir, model_dir)
        final = policy.state_dict()
        after = after_update(policy) if after_update is not None else None
        return Update(initial, with_old.old_logprobs, stats, final, seen, after)
    finally:
        policy.close()


@pytest.fixture(scope="module")
def model_dir():
    from rlep.common.tiny_model import cached_model

    return cached_model("tiny")


@pytest.fixture(scope="module")
def batch() -> ExperienceBatch:
    return synthetic_batch(vocab=100, pad_id=0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def updates(ray_local, model_dir, batch, hf_dir, tmp_path_factory) -> dict[str, Update]:
    """Every case's update. ZeRO-2 and ZeRO-3 over two processes (CASES[1], CASES[2]) are first looked at by the
    host-copy and the gather tests (their `before_update`); the reference goes on to the clipping test's two updates
    (its `after_update`)."""
    observe = {
        "zero2-x2": lambda policy: host_copies(policy, model_dir, tmp_path_factory.mktemp("host_copies")),
        "zero3-x2": gathers_and_broadcast,
    }
    return {
        case_id(case): run_update(
            model_dir,
            batch,
            case,
            hf_dir if case == CASES[0] else None,
            observe.get(case_id(case)),
            (lambda policy: clipped_updates(policy, batch)) if case == CASES[0] else None,
        )
        for case in CASES
    }


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    return diff / sum(float(reference[k].pow(2).sum()) for k in reference) ** 0.5


@pytest.mark.parametrize("case", CASES[1:], ids=case_id)
def test_update_does_not_depend_on_zero_stage_or_processes(updates, case):
    ref_initial, ref_old, ref_stats, ref_final, *_ = updates[case_id(CASES[0])]
    initial, old, stats, final, *_ = updates[case_id(case)]
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
    initial, _, stats, final, *_ = updates[case_id(CASES[0])]
    moved = {k for k in final if not torch.equal(final[k], initial[k])}
    assert moved == set(final)
    # No warm-up: the first of the two Adam steps already uses the full lr (~lr per weight per step).
    largest = max(float((final[k] - initial[k]).abs().max()) for k in final)
    assert 1.5e-3 < largest < 2.1e-3
    assert stats["lr"] == pytest.approx(LR)


def signed_tokens(batch: ExperienceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(response tokens, those of rows with A > 0, those of rows with A < 0) as boolean masks."""
    mask = batch.loss_mask.bool()
    return mask, (batch.advantages > 0)[:, None] & mask, (batch.advantages < 0)[:, None] & mask


def clipped_updates(policy, batch: ExperienceBatch) -> tuple[dict[str, float], dict[str, float]]:
    """The clipping test's two one-mini-batch updates (its docstring says why these ratios)."""
    _, positive, negative = signed_tokens(batch)
    current = policy.logprobs(batch)
    old = torch.where(positive, current - math.log(1.25), current)
    higher = policy.update(batch.with_old_logprobs(old), rows_per_mini_batch=batch.size)
    current = policy.logprobs(batch)  # the first update moved the weights
    old = torch.where(negative, current - math.log(0.75), current)
    lower = policy.update(batch.with_old_logprobs(old), rows_per_mini_batch=batch.size)
    return higher, lower


def test_the_update_clips_with_dapos_asymmetric_bounds(updates, batch):
    """The default clip_low 0.2 / clip_high 0.28 (DAPO's) reach the update's loss the right way round: the ratio is
    clipped to [0.8, 1.28]. On the reference policy after its update (`clipped_updates`): on the first update's one
    mini-batch (before its optimizer step) the ratio is 1.25 on the tokens of rows with A > 0 (inside 1 + 0.28:
    nothing clipped; swapped, 1 + 0.2 would clip them all), then 0.75 on the tokens of rows with A < 0 (outside
    1 - 0.2: every one clipped; swapped, 1 - 0.28 would clip none)."""
    from rlep.services.learner.config import AlgorithmConfig

    assert (AlgorithmConfig().clip_low, AlgorithmConfig().clip_high) == (0.2, 0.28)
    reference = updates[case_id(CASES[0])]
    higher, lower = reference.after
    mask, positive, negative = signed_tokens(batch)
    assert positive.any() and negative.any()
    tokens = float(mask.sum())
    steps = reference.stats["optimizer_steps"]
    assert (higher["optimizer_steps"], lower["optimizer_steps"]) == (steps + 1, steps + 2)  # one mini-batch each
    # The old logprobs reached the loss: approx_kl is the mean of -log ratio over the response tokens.
    assert higher["approx_kl"] == pytest.approx(-math.log(1.25) * float(positive.sum()) / tokens, abs=1e-5)
    assert lower["approx_kl"] == pytest.approx(-math.log(0.75) * float(negative.sum()) / tokens, abs=1e-5)
    assert higher["clip_fraction"] == 0.0
    assert lower["clip_fraction"] == pytest.approx(float(negative.sum()) / tokens, rel=1e-6)
    assert higher["clip_fraction_dual"] == lower["clip_fraction_dual"] == 0.0


def test_warmup_counts_training_steps_whatever_their_mini_batches_and_resumes(ray_local, model_dir, batch, tmp_path):
    """warmup_steps=4: training steps 0..4 run at lr/4, lr/2, 3lr/4, lr, lr with 1 or 4 mini-batches each."""
    mini_batches = [1, 4, 1, 4, 1]
    policy = start_policy(model_dir, warmup_steps=4)
    try:
        initial = policy.state_dict()
        with_old = batch.with_old_logprobs(policy.logprobs(batch))
        stats = []
        for step, count in enumerate(mini_batches):
            stats.append(policy.update(with_old, rows_per_mini_batch=batch.size // count))
            if step == 0:
                # Adam's first step moves each weight by ~its lr: the lr really was lr/4.
                first = policy.state_dict()
                assert max(float((first[k] - initial[k]).abs().max()) for k in first) == pytest.approx(LR / 4, rel=0.05)
            if step == 1:
                policy.save_checkpoint(tmp_path, "step_2", policy.rng_state())
            if step == 2:  # what the resumed run must end on: weights and Adam's moments
                third = policy.state_dict()
                policy.save_checkpoint(tmp_path, "step_3", policy.rng_state())
    finally:
        policy.close()
    assert [s["lr"] for s in stats] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR, LR])
    assert [s["optimizer_steps"] for s in stats] == [1, 5, 6, 10, 11]

    resumed = start_policy(model_dir, warmup_steps=4)
    try:
        resumed.load_checkpoint(tmp_path, "step_2")
        after = resumed.update(with_old, rows_per_mini_batch=batch.size)
        resumed_weights = resumed.state_dict()
        resumed.save_checkpoint(tmp_path, "resumed_3", resumed.rng_state())
    finally:
        resumed.close()
    assert after["lr"] == pytest.approx(3 * LR / 4) and after["optimizer_steps"] == 6
    # The resumed step lands where the uninterrupted one did: same weights, same optimizer state. A resume that
    # left Adam's moments behind would restart them at 0 and move every weight by ~lr instead.
    assert after["loss"] == pytest.approx(stats[2]["loss"], rel=1e-5)
    assert assert_same_tree(resumed_weights, third) == len(third)
    (_, optimizer), (_, expected) = deepspeed_state(tmp_path / "resumed_3"), deepspeed_state(tmp_path / "step_3")
    moments = {k: v for k, v in expected["optimizer_state_dict"]["base_optimizer_state"]["state"][0].items()}
    assert {"exp_avg", "exp_avg_sq"} <= set(moments) and all(float(v.abs().max()) > 0 for v in moments.values())
    assert assert_same_tree(optimizer["optimizer_state_dict"], expected["optimizer_state_dict"]) > 2


def test_bf16_trains_in_bf16_and_pushes_the_checkpoint_dtype(updates, model_dir, batch, tmp_path):
    """Pushes match what the replicas loaded (the float32 checkpoint); the HF export keeps the training dtype."""
    from safetensors.torch import load_file

    ref_old = updates[case_id(CASES[0])].old
    policy = start_policy(model_dir, dtype="bf16")
    try:
        old = policy.logprobs(batch)
        policy.update(batch.with_old_logprobs(old), rows_per_mini_batch=batch.size // 2)
        state = policy.state_dict()
        policy.save_hf(tmp_path / "hf", model_dir)
    finally:
        policy.close()
    assert all(v.dtype == torch.float32 for v in state.values())  # the tiny checkpoint is float32
    assert all(torch.equal(v, v.bfloat16().float()) for v in state.values())  # held in bf16 while training
    # The export is not upcast: bf16 tensors (half the bytes), the same values, and a config that says so.
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert exported.keys() == state.keys() and all(v.dtype == torch.bfloat16 for v in exported.values())
    assert all(torch.equal(exported[k].float(), state[k]) for k in state)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(old[mask], ref_old[mask], atol=0.05, rtol=0.0)


def test_saved_checkpoint_keeps_tokenizer_and_chat_template(updates, model_dir, hf_dir):
    from transformers import AutoTokenizer

    from rlep.common.tiny_model import CHAT_TEMPLATE

    assert (hf_dir / "chat_template.jinja").exists()
    assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "float32"
    source, saved = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(hf_dir)
    assert saved.chat_template == source.chat_template == CHAT_TEMPLATE  # the tiny model's own template
    chat = [{"role": "user", "content": "What is 23+58?"}]
    rendered = saved.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == source.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    text = rendered + "\\boxed{81}\nTabs\tand (symbols) ~!@#"
    assert saved.encode(text) == source.encode(text)
    assert saved.decode(saved.encode(text)) == source.decode(source.encode(text))


def gathers_and_broadcast(policy) -> tuple[dict, dict, dict]:
    """On a started ZeRO-3 policy over two processes: (rank 0's state_dict, rank 1's, what a broadcast receiver got)."""
    import threading

    import ray

    from rlep.common.ports import free_port
    from rlep.services.weights.broadcast import BroadcastGroup, receive_state_dict, setup_communicator

    rank0, rank1 = ray.get([actor.state_dict.remote() for actor in policy.actors])
    group = BroadcastGroup(policy.broadcast_address(), free_port(), world_size=2, backend="gloo", timeout_s=60)
    entries, received = policy.weight_manifest(), {}

    def receive() -> None:
        communicator = setup_communicator(group, 1)
        received.update(receive_state_dict(communicator, entries))
        communicator.close()

    receiver = threading.Thread(target=receive)
    receiver.start()
    policy.broadcast_weights(group)
    receiver.join(60)
    return rank0, rank1, received


def test_zero3_weights_are_gathered_one_by_one_kept_on_rank_0_and_streamed_to_a_broadcast(updates, model_dir):
    """Under ZeRO-3 a rank > 0 takes part in every gather and keeps no copy ({}); rank 0's broadcast sends each
    parameter as it is gathered, and a receiver gets exactly the weights `state_dict()` returns (looked at on the
    zero3-x2 case's policy before its update)."""
    from safetensors.torch import load_file

    rank0, rank1, received = updates["zero3-x2"].seen
    checkpoint = load_file(model_dir / "model.safetensors")
    assert rank1 == {} and rank0.keys() == checkpoint.keys()
    assert all(torch.equal(rank0[k], checkpoint[k]) for k in checkpoint)
    assert received.keys() == checkpoint.keys()
    assert all(torch.equal(received[k], checkpoint[k]) for k in checkpoint)


def _host_bytes_allocated(process, call: str, *args):
    """Runs `process.policy.<call>(*args)` inside a learner actor (through Ray's `__ray_call__`), counting the bytes
    of every host tensor it allocates: each op's outputs whose storage none of its inputs shares. Returns (bytes,
    the call's result)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    def host_storages(tree) -> dict[int, int]:
        tensors = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    class CountAllocations(TorchDispatchMode):
        allocated = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = host_storages((args, kwargs))
            self.allocated += sum(size for ptr, size in host_storages(out).items() if ptr not in inputs)
            return out

    with CountAllocations() as counter:
        result = getattr(process.policy, call)(*args)
    return counter.allocated, result


class HostCopies(NamedTuple):
    """(rank 0's, rank 1's) (bytes of host tensors allocated, result) per call, on ZeRO-2 over two processes."""

    state_dict: tuple[tuple[int, dict], tuple[int, dict]]
    manifest: tuple[tuple[int, list], tuple[int, list]]
    save_hf: tuple[tuple[int, None], tuple[int, None]]
    rank1_push: tuple[int, Any]
    hf_dir: Path


def host_copies(policy, model_dir: Path, tmp: Path) -> HostCopies:
    import ray

    from rlep.services.rollout.client import ReplicaTarget
    from rlep.services.weights.config import AutoSyncConfig

    def on_both(call: str, *args):
        return tuple(ray.get([a.__ray_call__.remote(_host_bytes_allocated, call, *args) for a in policy.actors]))

    state_dict, manifest, save_hf = (
        on_both("state_dict"),
        on_both("weight_manifest"),
        on_both("save_hf", tmp, model_dir),
    )
    # A push's payload is rank 0's to send (outside ZeRO-3 no rank waits on another): rank 1 alone is asked.
    target = ReplicaTarget(addresses=("127.0.0.1:9",), token=None, timeout_s=1.0)
    push = ray.get(
        policy.actors[1].__ray_call__.remote(_host_bytes_allocated, "push_weights", target, 1, AutoSyncConfig())
    )
    return HostCopies(state_dict, manifest, save_hf, push, tmp)


def test_outside_zero3_only_rank_0_copies_the_weights_to_the_host(updates, model_dir):
    """state_dict, the broadcast manifest, the HF export and a payload push are sent or saved by rank 0 alone: a
    rank > 0 makes no host copy of the weights for them (at 7B: 15.2 GB per process), and the manifest needs none
    on rank 0 either. Counted as the bytes of host tensors each call allocates, on the zero2-x2 case's policy before
    its update."""
    seen: HostCopies = updates["zero2-x2"].seen
    model_bytes = (model_dir / "model.safetensors").stat().st_size  # 4 MB of float32 weights
    (rank0_bytes, rank0_state), (rank1_bytes, rank1_state) = seen.state_dict
    assert rank0_state.keys() and rank1_state == {}
    assert rank0_bytes >= 0.99 * model_bytes and rank1_bytes == 0
    (rank0_bytes, manifest), (rank1_bytes, rank1_manifest) = seen.manifest
    assert [name for name, _ in manifest] == list(rank0_state) and rank1_manifest == []
    assert rank0_bytes == rank1_bytes == 0
    (rank0_bytes, _), (rank1_bytes, _) = seen.save_hf
    assert rank0_bytes >= 0.99 * model_bytes and rank1_bytes == 0
    assert (seen.hf_dir / "model.safetensors").exists()
    rank1_bytes, answer = seen.rank1_push
    assert answer is None and rank1_bytes == 0


def _count_trace_invalidations(process) -> None:
    """From now on, counts in `process.trace_invalidations` each time ZeRO-3 drops its prefetch trace in this actor
    (what DeepSpeed's "Invalidate trace cache" message reports when its trace-cache warnings are on)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    process.trace_invalidations = 0
    invalidate = PartitionedParameterCoordinator._invalidate_trace

    def counted(coordinator) -> None:
        process.trace_invalidations += 1
        invalidate(coordinator)

    PartitionedParameterCoordinator._invalidate_trace = counted


def test_zero3_keeps_its_prefetch_trace_over_micro_batches_of_different_lengths(ray_local, model_dir):
    """Micro-batches of ~1,300 and ~500 positions (2 and 1 chunks of 1,024 by length alone) run the LM head equally
    often, so ZeRO-3's trace of one pass still holds for the next: old logprobs and an update drop it once at most
    (where forward-only passes give way to training ones): 1 here, 2 with the head run as often as each length needs."""
    import ray

    from rlep.common.types import Group, Source, Trajectory
    from rlep.services.learner.batch import build_batch

    generator = torch.Generator().manual_seed(3)
    groups = []
    for q, lengths in enumerate([(640, 620, 240, 230), (630, 610, 250, 220)]):
        prompt = tuple(int(t) for t in torch.randint(2, 100, (20,), generator=generator))
        trajectories = [
            Trajectory(
                f"q{q}",
                "",
                reward=1.0 if k % 2 else -1.0,
                source=Source.FRESH,
                prompt_token_ids=prompt,
                response_token_ids=tuple(int(t) for t in torch.randint(2, 100, (n,), generator=generator)),
            )
            for k, n in enumerate(lengths)
        ]
        groups.append(Group(f"q{q}", "0", trajectories))
    long_rows = build_batch(groups, pad_id=0)
    policy = start_policy(model_dir, stage=3, processes=1, optim={"micro_batch_size": 2})
    try:
        ray.get(policy.actors[0].__ray_call__.remote(_count_trace_invalidations))
        with_old = long_rows.with_old_logprobs(policy.logprobs(long_rows))  # 4 forward-only micro-batches
        policy.update(with_old, rows_per_mini_batch=long_rows.size // 2)  # 2 mini-batches x 2 micro-batches
        invalidations = ray.get(policy.actors[0].__ray_call__.remote(lambda process: process.trace_invalidations))
    finally:
        policy.close()
    assert invalidations <= 1


@pytest.mark.parametrize(("stage", "processes"), [(2, 1), (3, 2)], ids=["zero2", "zero3-x2"])
def test_the_processed_view_then_a_kl_term_against_the_frozen_starting_weights(
    ray_local, model_dir, batch, stage, processes
):
    """One policy per ZeRO case (each start costs seconds of engine set-up), two behaviours in order:

    `logprobs_with_processed` (each rank its rows, summed), before any update: its logprobs are `logprobs`'; its
    processed ones at T=1, top_p=1 the raw logprobs, at T=0.7, top_p=0.9 those of transformers' logits through
    `processed_logprobs` on the same weights.

    Then the KL term: the reference is the starting checkpoint and stays it while the policy trains (partitioned
    under ZeRO-3); the step's statistics carry the KL estimate, 0 before the policy moves and positive after."""
    from transformers import AutoModelForCausalLM

    from rlep.services.learner.batch import processed_logprobs

    policy = start_policy(model_dir, stage, processes, algorithm={"kl_coef": 0.1, "entropy_coef": 0.01})
    try:
        raw, (alongside, untempered) = policy.logprobs(batch), policy.logprobs_with_processed(batch, 1.0, 1.0)
        _, tempered = policy.logprobs_with_processed(batch, 0.7, 0.9)
        old, ref = policy.logprobs(batch), policy.reference_logprobs(batch)
        stats = policy.update(batch.with_old_logprobs(old).with_ref_logprobs(ref), rows_per_mini_batch=batch.size)
        moved, still = policy.logprobs(batch), policy.reference_logprobs(batch)
        second = policy.update(batch.with_old_logprobs(moved).with_ref_logprobs(still), batch.size)
    finally:
        policy.close()
    mask = batch.loss_mask.bool()
    assert torch.equal(alongside, raw)  # the same forward pass's logprobs as the plain call's
    torch.testing.assert_close(untempered[mask], raw[mask], atol=1e-5, rtol=0.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits[:, :-1]
    expected = processed_logprobs(logits.reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1), 0.7, 0.9)
    expected = expected.view(mask.shape)
    assert torch.equal(torch.isinf(tempered[mask]), torch.isinf(expected[mask]))
    finite = mask & torch.isfinite(expected)
    torch.testing.assert_close(tempered[finite], expected[finite], atol=1e-4, rtol=0.0)
    assert (tempered[finite] - raw[finite]).abs().max() > 1e-2  # a different distribution from the raw one

    torch.testing.assert_close(ref[mask], old[mask], atol=1e-5, rtol=0.0)  # the same weights, before any update
    assert torch.equal(still, ref)  # frozen
    assert (moved[mask] - old[mask]).abs().max() > 1e-4  # while the policy moved
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # one mini-batch: scored before its only update
    assert second["kl_ref"] > 1e-7
