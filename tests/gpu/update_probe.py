"""Run as a script by tests/gpu/: one learner update with the real `DeepSpeedPolicy` in a process of its own (one
process group each), on CUDA or, with CUDA_VISIBLE_DEVICES="", on the CPU; writes what the tests compare to a
torch file: the old logprobs, the update's statistics, the weights before and after, the peak GPU memory.

    python tests/gpu/update_probe.py MODEL_DIR OUT.pt --stage 2 [--bf16] [--checkpointing]
        [--save-checkpoint DIR] [--load-checkpoint DIR]
"""

from __future__ import annotations

import argparse
import sys
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
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on CUDA compared with fp32 on the CPU
    config = TrainConfig.model_validate(
        {
            "seed": 11,
            "algorithm": {"questions_per_step": 4, "mini_batch_questions": 2},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0, "micro_batch_size": 3},
            "deepspeed": {
                "zero_stage": args.stage,
                "dtype": "bf16" if args.bf16 else "fp32",
                "gradient_checkpointing": args.checkpointing,
            },
        }
    )
    init_distributed(0, 1, "127.0.0.1", free_port())
    policy = DeepSpeedPolicy(args.model, config)
    if args.load_checkpoint:
        policy.load_checkpoint(args.load_checkpoint)
    rng_after_load = rng_states()
    initial = policy.state_dict()
    batch = synthetic_batch(policy.hf_model.config.vocab_size)
    old = policy.logprobs(batch)
    stats = policy.update(batch.with_old_logprobs(old), rows_per_mini_batch=batch.size // 2)
    rng_at_save = rng_states()
    if args.save_checkpoint:
        policy.save_checkpoint(args.save_checkpoint, "probe", policy.rng_state())
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    torch.save(
        {
            "device": str(policy.device),
            "adam": policy.adam,
            "old_logprobs": old,
            "loss_mask": batch.loss_mask,
            "stats": stats,
            "initial": initial,
            "final": policy.state_dict(),
            "rng_after_load": rng_after_load,
            "rng_at_save": rng_at_save,
            "peak_bytes": peak,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
