"""Host memory of a ZeRO-3 full-weight gather on each learner process: this learner's gather (one parameter at a
time, rank 0 keeps the copies) next to the whole-model gather it replaced (every rank gathers every parameter and
copies it to the host), in one run.

Two gloo processes (`torch.multiprocessing`), a random Qwen2 of ~40M parameters (160 MB in float32), ZeRO-3; each
gather runs in a pair of fresh processes (the allocator keeps freed memory, so a second gather in the same process
would reuse the first's). Each process resets its peak resident memory (`/proc/self/clear_refs`, Linux), gathers,
and reports its peak growth (`VmHWM` minus the resident memory before) in MB.

    python benchmarks/zero3_gather_memory.py [--layers 8] [--hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_growth_mb(run) -> float:
    """Peak resident memory added while `run()` ran, in MB."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = status_kb("VmRSS")
    run()
    return (status_kb("VmHWM") - before) / 1024


def whole_model_gather(policy) -> dict:
    """The gather this learner replaced: every rank gathers every parameter at once and copies it to the host."""
    import deepspeed

    module = policy.hf_model
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


GATHERS = {
    "this learner (one parameter at a time, rank 0 keeps)": lambda policy: policy.state_dict(),
    "whole-model gather on every rank (before)": whole_model_gather,
}


def worker(rank: int, model_dir: str, port: int, out: str, gather: str) -> None:
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.policy import DeepSpeedPolicy, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, 2, "127.0.0.1", port)
    config = TrainConfig.model_validate({"deepspeed": {"zero_stage": 3, "num_processes": 2}})
    policy = DeepSpeedPolicy(Path(model_dir), config, rank, 2)
    growth = peak_growth_mb(lambda: GATHERS[gather](policy))
    Path(f"{out}.{rank}.json").write_text(json.dumps(growth))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlep.common.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        config = Qwen2Config(
            vocab_size=32000,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            tie_word_embeddings=True,
        )
        model = Qwen2ForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        ranks: list[dict[str, float]] = [{}, {}]
        for index, gather in enumerate(GATHERS):
            out = str(Path(tmp) / f"gather{index}")
            mp.spawn(worker, args=(tmp, free_port(), out, gather), nprocs=2, join=True)
            for rank in range(2):
                ranks[rank][gather] = json.loads(Path(f"{out}.{rank}.json").read_text())
    table = Table(title=f"ZeRO-3 full-weight gather, {params / 1e6:.0f}M parameters ({params * 4 / 2**20:.0f} MB fp32)")
    for column in ("gather", "rank 0: peak growth MB", "rank 1: peak growth MB"):
        table.add_column(column)
    for name in ranks[0]:
        table.add_row(name, f"{ranks[0][name]:.0f}", f"{ranks[1][name]:.0f}")
    Console().print(table)
    print(json.dumps({"parameters": params, "ranks": ranks}))


if __name__ == "__main__":
    main()
