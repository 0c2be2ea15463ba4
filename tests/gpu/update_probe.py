"""Run as a script by tests/gpu/ and tests/gpu/paths_probe.py: one learner update with the real `DeepSpeedPolicy` in a
process of its own (one process group each), on CUDA or, with CUDA_VISIBLE_DEVICES="", on the CPU; writes what the
callers compare to a torch file: the old logprobs, the update's statistics, the weights before and after, the peak GPU
memory, and what the optional paths add (the KL reference's logprobs and a second update, the broadcast's tensors).

    python tests/gpu/update_probe.py MODEL_DIR OUT.pt --stage 2 [--bf16] [--checkpointing]
        [--save-checkpoint DIR] [--load-checkpoint DIR] [--lora RANK] [--kl-coef C] [--offload]
        [--micro-batch-tokens N] [--save-hf DIR] [--device-weights]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from rlep.common.ports import free_port
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.policy import DeepSpeedPolicy, init_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root, for tests.learner_batches
from tests.learner_batches import synthetic_batch  # noqa: E402


def rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--save-checkpoint", type=Path)
    parser.add_argument("--load-checkpoint", type=Path)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: every weight trains)")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0: a KL term against the reference policy")
    parser.add_argument("--offload", action="store_true", help="Adam's state in host memory")
    parser.add_argument("--micro-batch-tokens", type=int, help="the micro-batches' token budget")
    parser.add_argument("--save-hf", type=Path, help="write the HF export here after the update")
    parser.add_argument("--device-weights", action="store_true", help="record the tensors a broadcast sends")
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on CUDA compared with fp32 on the CPU
    config = TrainConfig.model_validate(
        {
            "seed": 11,
            "algorithm": {"questions_per_step": 4, "mini_batch_questions": 2, "kl_coef": args.kl_coef},
            "optim": {
                "lr": 1e-3,
                "warmup_steps": 0,
                "weight_decay": 0.0,
                "micro_batch_size": 3,
                "micro_batch_tokens": args.micro_batch_tokens,
            },
            "deepspeed": {
                "zero_stage": args.stage,
                "dtype": "bf16" if args.bf16 else "fp32",
                "gradient_checkpointing": args.checkpointing,
                "offload_optimizer": args.offload,
            },
            "lora": {"rank": args.lora, "alpha": 2.0 * args.lora} if args.lora else {},
        }
    )
    started = time.perf_counter()
    init_distributed(0, 1, "127.0.0.1", free_port())
    policy = DeepSpeedPolicy(args.model, config)
    if args.load_checkpoint:
        policy.load_checkpoint(args.load_checkpoint)
    build_s = time.perf_counter() - started
    rng_after_load = rng_states()
    initial = policy.state_dict()
    batch = synthetic_batch(policy.hf_model.config.vocab_size)
    old = policy.logprobs(batch)
    extra = {}
    if args.kl_coef:
        extra["ref_logprobs"] = policy.reference_logprobs(batch)
        batch = batch.with_ref_logprobs(extra["ref_logprobs"])
    started = time.perf_counter()
    stats = policy.update(batch.with_old_logprobs(old), rows_per_mini_batch=batch.size // 2)
    update_s = time.perf_counter() - started
    rng_at_save = rng_states()
    after = policy.logprobs(batch)
    if args.kl_coef:  # the reference stays the starting weights while the policy moves
        extra["ref_after"] = policy.reference_logprobs(batch)
        second = batch.with_old_logprobs(after).with_ref_logprobs(extra["ref_after"])
        extra["second_stats"] = policy.update(second, rows_per_mini_batch=batch.size)
    if args.device_weights:
        extra["device_weights"] = device_weights(policy)
    if args.save_checkpoint:
        policy.save_checkpoint(args.save_checkpoint, "probe", policy.rng_state())
    if args.save_hf:
        policy.save_hf(args.save_hf, args.model)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    torch.save(
        {
            "device": str(policy.device),
            "adam": policy.adam,
            "old_logprobs": old,
            "after_logprobs": after,
            "loss_mask": batch.loss_mask,
            "stats": stats,
            "initial": initial,
            "final": policy.state_dict(),
            "rng_after_load": rng_after_load,
            "rng_at_save": rng_at_save,
            "peak_bytes": peak,
            "build_s": build_s,
            "update_s": update_s,
            **extra,
        },
        args.out,
    )


def device_weights(policy: DeepSpeedPolicy) -> dict:
    """What a broadcast sends, tensor by tensor as rank 0 reads it (on the device, one gathered parameter at a time
    under ZeRO-3): name, device, dtype and a host copy; and the manifest the receivers are told to expect."""
    sent = [(name, str(t.device), t.dtype, t.detach().to("cpu", copy=True)) for name, t in policy._device_weights()]
    return {
        "sent": sent,
        "manifest": [(name, info.dtype, tuple(info.shape)) for name, info in policy.weight_manifest()],
    }


if __name__ == "__main__":
    main()
