"""LoRA against full fine-tuning on one learner process: trainable parameters, peak memory, update time, checkpoint.

Each side runs in its own subprocess of this script (so each peak RSS is that side's own, loading included, and no
DeepSpeed state crosses over): one `DeepSpeedPolicy` (DeepSpeed on gloo, no Ray) loads the model, computes old
logprobs of a synthetic batch (`--rows` rows of `--tokens` tokens, half prompt) and runs one untimed update, then
`--repeats` timed updates (the median is reported), pushes once (`state_dict`: under LoRA the merge), and writes
one DeepSpeed checkpoint (its size on disk is reported; the HF export is the same size either way).

    python benchmarks/lora.py                                   # the tiny model, rank 8
    python benchmarks/lora.py --model ~/.cache/rlep/models/smollm2-135m-instruct --rows 8 --tokens 256
    python benchmarks/lora.py --set lora.rank=16 --set deepspeed.dtype=bf16
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = {"full": [], "lora": ["lora.rank=8", "lora.alpha=16"]}


def run_side(args: argparse.Namespace, sets: list[str]) -> dict:
    import torch
    from synthetic_batch import synthetic_batch

    from rlep.common.config import load_config
    from rlep.common.ports import free_port
    from rlep.common.tiny_model import resolve_model
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.policy import DeepSpeedPolicy, init_distributed

    model = Path(resolve_model(args.model))
    config = load_config(
        TrainConfig,
        {
            "model": str(model),
            "algorithm": {"questions_per_step": 1, "mini_batch_questions": 1, "fresh_per_question": args.rows},
            "optim": {"micro_batch_size": args.rows, "warmup_steps": 0, "lr": 1e-5},
            "deepspeed": {"zero_stage": 2},
        },
        sets=sets,
    )
    torch.set_num_threads(args.threads)
    init_distributed(0, 1, "127.0.0.1", free_port())
    policy = DeepSpeedPolicy(model, config)
    params = list(policy.engine.module.parameters())
    vocab = policy.hf_model.config.vocab_size
    prompt = args.tokens // 2
    batch = synthetic_batch(vocab, prompt, [args.tokens - prompt] * args.rows)
    batch = batch.with_old_logprobs(policy.logprobs(batch))
    policy.update(batch, rows_per_mini_batch=args.rows)  # warm-up
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        policy.update(batch, rows_per_mini_batch=args.rows)
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    policy.state_dict()
    push_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as scratch:
        policy.save_checkpoint(Path(scratch), "step", policy.rng_state())
        checkpoint_bytes = sum(p.stat().st_size for p in Path(scratch).rglob("*") if p.is_file())
    return {
        "model": str(args.model),
        "overrides": sets,
        "parameters": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "update_s": round(statistics.median(times), 3),
        "full_weights_s": round(push_s, 3),
        "deepspeed_checkpoint_mb": round(checkpoint_bytes / 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="an HF directory or a tiny-model preset")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="prompt + response tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="config override for both sides")
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)  # a subprocess's own side
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args, SIDES[args.side] + args.set)))
        return
    results = {}
    for side in SIDES:
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--side", side], check=True, capture_output=True, text=True
        ).stdout
        results[side] = json.loads(out.strip().splitlines()[-1])
        print(json.dumps({"side": side, **results[side]}), flush=True)
    full, lora = results["full"], results["lora"]
    print(
        f"trainable {lora['trainable']:,} / {full['trainable']:,} ({lora['trainable'] / full['trainable']:.2%}); "
        f"peak RSS {lora['peak_rss_mib']} / {full['peak_rss_mib']} MiB; update {lora['update_s']} / "
        f"{full['update_s']} s; DeepSpeed checkpoint {lora['deepspeed_checkpoint_mb']} / "
        f"{full['deepspeed_checkpoint_mb']} MB (LoRA / full)"
    )


if __name__ == "__main__":
    main()
