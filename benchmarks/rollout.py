"""Rollout: the service vs the raw engine, and weight pushes vs a raw safetensors save + load.

1. Generation: the same prompts and sampling (seeded, so both produce the same tokens) through
   (a) `vllm.LLM.generate` in a plain process and (b) a `rlep serve rollout` worker (1 replica)
   called through the typed client over loopback gRPC, alternating run by run so both see the
   same machine load. Prints tokens/s of each (medians) and the ratio (goal >= 0.95).
2. Weight push, for the tiny model and a ~100M-parameter config: `RolloutClient.push_weights` over
   both file transports (`StreamTransport`: streamed bytes, `SharedFileTransport`: shared-memory file)
   vs writing the same tensors with `safetensors.torch.save_file` to the same (shared-memory) filesystem
   and loading them back into the model (goal: push <= 2x raw). The three are alternated round by round
   (at least 5 rounds, each in a rotated order) so they see the same machine load; medians and the
   min-max spread are printed, since a single raw figure swung 0.26-0.90 s between runs.

    python benchmarks/rollout.py [--prompts 64] [--n 8] [--max-tokens 64] [--repeats 3] [--eager]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

console = Console(width=None if sys.stdout.isatty() else 140)  # a log file gets whole tables, not 80 columns


def workload(args) -> tuple[list[str], dict]:
    prompts = [f"Q: {a}+{b}=?\nA: " for a, b in zip(range(args.prompts), range(7, 7 + args.prompts), strict=True)]
    sampling = dict(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=1234)
    return prompts, sampling


def engine_config(args, model: str):
    from rlep.services.rollout.config import EngineConfig

    return EngineConfig(model=model, enforce_eager=args.eager, max_num_seqs=256)


def raw_engine_serve(args, conn) -> None:
    """Child process: plain vLLM with the service's engine arguments; one timed run per request."""
    from vllm import LLM, SamplingParams

    from rlep.services.rollout.vllm_args import engine_kwargs, shutdown_llm

    prompts, sampling = workload(args)
    llm = LLM(**engine_kwargs(engine_config(args, "tiny")))
    params = SamplingParams(**sampling, logprobs=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    conn.send("ready")
    while conn.recv() == "run":
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        conn.send(
            {
                "tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
                "seconds": time.perf_counter() - started,
            }
        )
    shutdown_llm(llm)


def start_worker(args, model: str, port: int) -> subprocess.Popen:
    from tests.integration.test_serve_cli import rlep_command, wait_serving

    cmd = [*rlep_command(), "serve", "rollout", "--port", str(port), "--set", f"engine.model={model}"]
    cmd += ["--set", f"engine.enforce_eager={str(args.eager).lower()}", "--set", "engine.max_num_seqs=256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_serving(port, timeout_s=900)
    return proc


def generation_side_by_side(args, client, conn) -> dict:
    """Alternates raw and service runs so both see the same machine load; medians of each."""
    from rlep.services.rollout.types import Sampling

    prompts, sampling = workload(args)
    client.generate(prompts, Sampling(**sampling))  # warm-up
    raw, service = [], []
    for _ in range(args.repeats):
        conn.send("run")
        raw.append(conn.recv())
        started = time.perf_counter()
        completions = client.generate(prompts, Sampling(**sampling))
        service.append(
            {
                "tokens": sum(len(s.token_ids) for c in completions for s in c.samples),
                "seconds": time.perf_counter() - started,
            }
        )
    median = lambda runs: {"tokens": runs[-1]["tokens"], "seconds": statistics.median(r["seconds"] for r in runs)}  # noqa: E731
    return {"raw": median(raw), "service": median(service)}


def push_timings(args, client, model_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from rlep.services.weights.staging import default_staging_dir
    from rlep.services.weights.transport import SharedFileTransport, StreamTransport

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    params = sum(t.numel() for t in state.values())
    version = client.versions()[0]

    def raw_save_load() -> None:
        with tempfile.TemporaryDirectory(dir=default_staging_dir()) as tmp:
            save_file(state, f"{tmp}/w.safetensors")
            # load_file maps the file lazily; copying into a model is what makes it a load.
            model.load_state_dict(load_file(f"{tmp}/w.safetensors"), strict=False)

    def pusher(transport):
        def push() -> None:
            nonlocal version
            version += 1
            client.push_weights(state, version, transport=transport)

        return push

    runs = {
        "raw_save_load": raw_save_load,
        "stream": pusher(StreamTransport()),
        "shared_file": pusher(SharedFileTransport()),
    }
    timings: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_index in range(max(args.repeats, 5)):
        for name in names[round_index % 3 :] + names[: round_index % 3]:  # rotated: no one always goes first
            started = time.perf_counter()
            runs[name]()
            timings[name].append(time.perf_counter() - started)
    result: dict = {"params": params, "rounds": len(timings["stream"])}
    for name, values in timings.items():
        result[name] = statistics.median(values)
        result[f"{name}_spread"] = [min(values), max(values)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="skip torch.compile (faster start, slower decode)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    from rlep.common.tiny_model import cached_model
    from rlep.services.rollout.client import RolloutClient
    from tests.conftest import free_port

    for preset in ("tiny", "100m"):
        cached_model(preset)
    results: dict = {}
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=raw_engine_serve, args=(args, child_conn))
    with console.status("starting the raw vLLM engine (child process)..."):
        child.start()
        conn.recv()
    for preset in ("tiny", "100m"):
        with console.status(f"rollout service with the {preset} model..."):
            port = free_port()
            proc = start_worker(args, preset, port)
            client = RolloutClient([f"127.0.0.1:{port}"], timeout_s=900)
            try:
                if preset == "tiny":
                    results.update(generation_side_by_side(args, client, conn))
                    conn.send("stop")
                    child.join()
                results[f"push_{preset}"] = push_timings(args, client, cached_model(preset))
            finally:
                client.close()
                proc.terminate()
                proc.wait(timeout=60)
    report(args, results)


def report(args, results: dict) -> None:
    raw, service = results["raw"], results["service"]
    raw_tps, service_tps = raw["tokens"] / raw["seconds"], service["tokens"] / service["seconds"]
    table = Table(title=f"generation: {args.prompts} prompts x n={args.n} x {args.max_tokens} tokens, tiny model")
    for column in ("path", "tokens", "seconds (median)", "tokens/s"):
        table.add_column(column, justify="right")
    table.add_row("raw vllm.LLM.generate", str(raw["tokens"]), f"{raw['seconds']:.3f}", f"{raw_tps:,.0f}")
    table.add_row(
        "rollout service (1 replica)", str(service["tokens"]), f"{service['seconds']:.3f}", f"{service_tps:,.0f}"
    )
    console.print(table)
    ratio = service_tps / raw_tps
    console.print(
        f"generation ratio service/raw = [bold]{ratio:.3f}[/bold]"
        f" (goal >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})"
    )

    pushes = Table(title="weight push vs safetensors save_file + load_file: median seconds (min-max), alternated")
    for column in ("model", "params", "stream", "shared_file", "raw save+load", "stream/raw", "shared/raw"):
        pushes.add_column(column, justify="right")
    for preset in ("tiny", "100m"):
        p = results[f"push_{preset}"]
        pushes.add_row(
            preset,
            f"{p['params'] / 1e6:.1f}M",
            *(
                f"{p[k]:.3f} ({p[k + '_spread'][0]:.2f}-{p[k + '_spread'][1]:.2f})"
                for k in ("stream", "shared_file", "raw_save_load")
            ),
            f"{p['stream'] / p['raw_save_load']:.2f}",
            f"{p['shared_file'] / p['raw_save_load']:.2f}",
        )
    console.print(pushes)
    big = results["push_100m"]
    best = min(big["stream"], big["shared_file"]) / big["raw_save_load"]
    console.print(
        f"100M push ratio (best transport)/raw = [bold]{best:.2f}[/bold]"
        f" (goal <= 2: {'met' if best <= 2 else 'NOT met'})"
    )
    results["generation_ratio"] = ratio
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
