"""Peak RSS of one learner process doing one RLEP update on a real model (default: SmolLM2-135M-Instruct).

One `DeepSpeedPolicy` (DeepSpeed on gloo, one process, no Ray) loads the model, computes old logprobs
and runs one PPO update over a synthetic batch shaped like a real step (default 8 rows x 380 tokens,
as measured in issue 11), then reports the process's peak resident memory (`ru_maxrss`) and the time
of each phase. Run it from another checkout to compare versions of the learner:

    python benchmarks/learner_memory.py --model ~/.cache/rlep/models/smollm2-135m-instruct
    python benchmarks/learner_memory.py --set deepspeed.dtype=bf16 --set deepspeed.gradient_checkpointing=true
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "rlep" / "models" / "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=380, help="prompt + response tokens per row")
    parser.add_argument("--set", action="append", default=[], help="config override, e.g. deepspeed.dtype=bf16")
    args = parser.parse_args()

    from synthetic_batch import synthetic_batch

    from rlep.common.config import load_config
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.policy import DeepSpeedPolicy, init_distributed

    # --set goes through the config loader: a key it names replaces that field only, not its whole section.
    config = load_config(
        TrainConfig,
        {
            "model": str(args.model),
            "algorithm": {"questions_per_step": 1, "mini_batch_questions": 1, "fresh_per_question": args.rows},
            "optim": {"micro_batch_size": args.rows, "warmup_steps": 0},
            "deepspeed": {"zero_stage": 2},
        },
        sets=args.set,
    )
    init_distributed(0, 1, "127.0.0.1", 29591)
    started = time.perf_counter()
    policy = DeepSpeedPolicy(args.model, config)
    load_s = time.perf_counter() - started
    module = policy.engine.module
    vocab = (module.config if hasattr(module, "config") else module.model.config).vocab_size  # older: the HF model
    prompt = 120
    batch = synthetic_batch(vocab, prompt, [args.tokens - prompt] * args.rows)
    started = time.perf_counter()
    batch = batch.with_old_logprobs(policy.logprobs(batch))
    logprob_s = time.perf_counter() - started
    started = time.perf_counter()
    policy.update(batch, rows_per_mini_batch=args.rows)
    update_s = time.perf_counter() - started
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        json.dumps(
            {
                "model": str(args.model),
                "rows": args.rows,
                "tokens_per_row": args.tokens,
                "vocab": vocab,
                "overrides": args.set,
                "peak_rss_gib": round(peak_gib, 2),
                "load_s": round(load_s, 1),
                "old_logprobs_s": round(logprob_s, 1),
                "update_s": round(update_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
