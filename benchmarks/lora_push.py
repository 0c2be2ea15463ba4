"""LoRA weight pushes to vLLM: merged weights (what RLEP sends) against the adapter alone (vLLM's LoRA path).

Issue 33 asks to measure both and keep the faster. A training step's rollout side costs one push plus one
generation, so both are timed, side by side in one run, on the same model, prompts and adapters:

- learner side (this process): the product's own `apply_lora` wrap; per push one simulated update of the adapters
  (fresh random A and B), then the payload each way: `merged_weights` written as one safetensors file (the
  staging-file push), or PEFT's `save_pretrained` of the adapter (what vLLM's LoRA loader reads).
- rollout side (one subprocess per way, so neither engine shares memory or threads with the other): a vLLM engine
  built from RLEP's own `engine_kwargs`; "merged" loads the file in place through the worker extension
  (`load_safetensors_file`, as every RLEP push does) and generates plainly; "adapter" starts with
  `enable_lora=True`, takes each version with `add_lora` (the previous one removed) and generates through it.
  Each push is followed by one generation of `--prompts` x `--samples` x `--max-tokens` tokens (EOS ignored, so
  both ways generate the same number of tokens).
- check: greedy continuations of the last version from both ways; the fraction of equal tokens is reported (the
  two ways compute the same model, so a low figure means one of them is wrong).

    python benchmarks/lora_push.py                             # SmolLM2-135M when imported, else the tiny model
    python benchmarks/lora_push.py --model tiny --pushes 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOLLM2 = Path.home() / ".cache/rlep/models/smollm2-135m-instruct"
WAYS = ("merged", "adapter")
CHECK_PROMPTS = 4
CHECK_TOKENS = 24


def prompts(count: int) -> list[str]:
    return [f"Question {i}: what is {17 * i + 3} + {29 * i + 11}? Think step by step." for i in range(count)]


def make_payloads(args: argparse.Namespace, scratch: Path) -> dict:
    """Per push, one simulated adapter update and its two payloads; the learner-side time and size of each."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rlep.common.tiny_model import resolve_model
    from rlep.services.learner.config import LoraConfig
    from rlep.services.learner.lora import apply_lora, merged_weights

    model_dir = resolve_model(args.model)
    model = apply_lora(
        AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32),
        LoraConfig(rank=args.rank, alpha=2.0 * args.rank),
    )
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    skip = frozenset({"lm_head.weight"}) if tied else frozenset()
    generator = torch.Generator().manual_seed(0)
    out: dict = {"model": model_dir, "merged_files": [], "adapter_dirs": [], "merged_s": [], "adapter_s": []}
    for version in range(args.pushes):
        with torch.no_grad():  # an update: adapters that change the model visibly (B != 0)
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        started = time.perf_counter()
        file = scratch / f"merged-{version}.safetensors"
        save_file({name: t.contiguous() for name, t in merged_weights(model, torch.float32, skip)}, str(file))
        out["merged_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        adapter = scratch / f"adapter-{version}"
        model.save_pretrained(str(adapter))
        out["adapter_s"].append(time.perf_counter() - started)
        out["merged_files"].append(str(file))
        out["adapter_dirs"].append(str(adapter))
    out["merged_bytes"] = Path(out["merged_files"][-1]).stat().st_size
    out["adapter_bytes"] = sum(p.stat().st_size for p in Path(out["adapter_dirs"][-1]).iterdir())
    return out


def run_way(args: argparse.Namespace, payloads: dict) -> dict:
    """One engine, `--pushes` x (push, generation); the pushes' and generations' times and the check's tokens."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from rlep.services.rollout.config import EngineConfig
    from rlep.services.rollout.engine import WORKER_EXTENSION
    from rlep.services.rollout.vllm_args import engine_kwargs, shutdown_llm

    adapter = args.way == "adapter"
    extra = {"enable_lora": True, "max_lora_rank": args.rank, "max_loras": 1} if adapter else {}
    config = EngineConfig(
        model=payloads["model"], dtype=args.dtype, max_model_len=1024, enforce_eager=True, extra_args=extra
    )
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(config), worker_extension_cls=WORKER_EXTENSION)
    start_s = time.perf_counter() - started
    sampling = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    push_s, generate_s, request = [], [], None
    try:
        for version in range(args.pushes):
            started = time.perf_counter()
            if adapter:
                new = LoRARequest(f"v{version}", version + 1, payloads["adapter_dirs"][version])
                if not llm.llm_engine.add_lora(new):
                    raise RuntimeError(f"vLLM did not take adapter version {version}")
                if request is not None:
                    llm.llm_engine.remove_lora(request.lora_int_id)
                request = new
            else:
                llm.collective_rpc("load_safetensors_file", args=(payloads["merged_files"][version],))
            push_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            outputs = llm.generate(prompts(args.prompts), sampling, lora_request=request, use_tqdm=False)
            generate_s.append(time.perf_counter() - started)
            tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        check = llm.generate(prompts(CHECK_PROMPTS), greedy, lora_request=request, use_tqdm=False)
    finally:
        shutdown_llm(llm)
    return {
        "way": args.way,
        "start_s": round(start_s, 2),
        "push_s": [round(t, 3) for t in push_s],
        "generate_s": [round(t, 3) for t in generate_s],
        "tokens_per_generation": tokens,
        "check_tokens": [list(o.outputs[0].token_ids) for o in check],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.is_dir() else "tiny")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (float32: the check compares exactly)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a subprocess's own way
    parser.add_argument("--payloads", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        print(json.dumps(run_way(args, json.loads(args.payloads.read_text()))))
        return
    with tempfile.TemporaryDirectory() as scratch:
        payloads = make_payloads(args, Path(scratch))
        listing = Path(scratch) / "payloads.json"
        listing.write_text(json.dumps(payloads))
        ways = {}
        for way in WAYS:
            run = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--way", way, "--payloads", str(listing)],
                capture_output=True,
                text=True,
            )
            if run.returncode:
                sys.exit(f"the {way} side failed:\n{run.stderr[-4000:]}")
            ways[way] = json.loads(run.stdout.strip().splitlines()[-1])
    report = summarize(args, payloads, ways)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def summarize(args: argparse.Namespace, payloads: dict, ways: dict) -> dict:
    """Medians per push (the first push and generation left out as warm-up when there are more)."""

    def median(values: list[float]) -> float:
        return round(statistics.median(values[1:] if len(values) > 1 else values), 3)

    merged, adapter = ways["merged"], ways["adapter"]
    pairs = list(zip(sum(merged["check_tokens"], []), sum(adapter["check_tokens"], []), strict=True))
    report = {
        "model": payloads["model"],
        "rank": args.rank,
        "dtype": args.dtype,
        "pushes": args.pushes,
        "tokens_per_generation": merged["tokens_per_generation"],
        "check_token_agreement": round(sum(a == b for a, b in pairs) / len(pairs), 3),
    }
    for way, side in ways.items():
        learner = median(payloads[f"{way}_s"])
        push, generate = median(side["push_s"]), median(side["generate_s"])
        report[way] = {
            "payload_bytes": payloads[f"{way}_bytes"],
            "learner_s": learner,
            "engine_push_s": push,
            "generate_s": generate,
            "tokens_per_s": round(side["tokens_per_generation"] / generate, 1),
            "step_s": round(learner + push + generate, 3),
            "engine_start_s": side["start_s"],
        }
    report["adapter_over_merged_step"] = round(report["adapter"]["step_s"] / report["merged"]["step_s"], 3)
    return report


if __name__ == "__main__":
    main()
