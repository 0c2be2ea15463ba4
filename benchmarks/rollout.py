"""Rollout: the service vs the raw engine, and weight pushes vs a raw safetensors save + load.

1. Generation: the same prompts and sampling (seeded, so both produce the same tokens) through
   (a) `vllm.LLM.generate` in a plain process and (b) a `rlep serve rollout` worker (1 replica)
   called through the typed client over loopback gRPC, alternating run by run so both see the
   same machine load. Prints tokens/s of each (medians) and the ratio (goal >= 0.95).
2. Weight push, for the tiny model, a ~100M- and a ~500M-parameter config: `RolloutClient.push_weights` over
   both file transports (`StreamTransport`: streamed bytes, `SharedFileTransport`: shared-memory file)
   vs writing the same tensors with `safetensors.torch.save_file` to the same (shared-memory) filesystem
   and loading them back into the model (goal: push <= 2x raw). The three are alternated round by round
   (at least 5 rounds, each in a rotated order, after one untimed round of each) so they see the same machine
   load; medians and the min-max spread are printed, since a single raw figure swung 0.26-0.90 s between runs.

   The worker's own figures (receive + check, engine load) are printed beside them: where a push's time goes.
3. Object store (with the push section's tiny and 100m workers): the bytes one weight push puts through Ray's
   object store when the driver fetches the state dict and pushes (before) vs when the learner's rank 0 pushes
   itself (now; goal: none), from Ray's own count of created objects (benchmarks/ray_bytes.py).

    python benchmarks/rollout.py [--prompts 64] [--n 8] [--max-tokens 64] [--repeats 3] [--eager]
        [--sections generation,push,object_store] [--push-models tiny,100m,500m]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
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


# A ~500M-parameter Qwen2 (fp32: ~2 GB a payload) built by this benchmark: pushes at a size where the payload,
# not per-call overhead, sets the time. Only the push section uses it (its worker starts with enforce_eager).
PUSH_MODELS = ("tiny", "100m", "500m")
TRANSPORTS = ("stream", "shared_file")


def push_model_dir(name: str) -> Path:
    from rlep.common.tiny_model import ModelSpec, cached_model

    if name == "500m":
        spec = ModelSpec(
            hidden_size=1280,
            num_layers=21,
            num_heads=20,
            num_kv_heads=4,
            intermediate_size=5120,
            tie_word_embeddings=False,
        )
        return cached_model(spec)
    return cached_model(name)


def push_timings(args, client, model_dir: Path) -> dict:
    """Raw save+load, stream and shared_file pushes of the same tensors, alternated round by round."""
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
    worker: dict[str, list[tuple[float, float]]] = {"stream": [], "shared_file": []}

    def raw_save_load() -> None:
        with tempfile.TemporaryDirectory(dir=default_staging_dir()) as tmp:
            save_file(state, f"{tmp}/w.safetensors")
            # load_file maps the file lazily; copying into a model is what makes it a load.
            model.load_state_dict(load_file(f"{tmp}/w.safetensors"), strict=False)

    def pusher(name, transport):
        def push() -> None:
            nonlocal version
            version += 1
            [reply] = client.push_weights(state, version, transport=transport)
            worker[name].append((reply.receive_seconds, reply.load_seconds))

        return push

    runs = {
        "raw_save_load": raw_save_load,
        "stream": pusher("stream", StreamTransport()),
        "shared_file": pusher("shared_file", SharedFileTransport()),
    }
    # One untimed round of each first: the first save_file, load and push pay one-off costs (the model's first
    # load_state_dict, the interpreter's first big allocations) that swung a single raw figure 0.21-1.57 s.
    for run in runs.values():
        run()
    for pairs in worker.values():
        pairs.clear()
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
    for name, pairs in worker.items():  # what the worker reports: receiving + checking, and the engine's load
        result[f"{name}_worker_receive"] = statistics.median(r for r, _ in pairs)
        result[f"{name}_worker_load"] = statistics.median(load for _, load in pairs)
    return result


# Models whose pushes the object-store section measures (a learner on Ray holds each: the 500M one would need
# ~8 GB for DeepSpeed's optimizer state beside the worker's copy).
OBJECT_STORE_MODELS = ("tiny", "100m")


def push_section(args, name: str) -> dict:
    """A rollout worker serving `name`, pushed to by both file transports and compared with raw save+load."""
    from benchmarks.rollout_worker import start_worker
    from rlep.common.ports import free_port
    from rlep.services.rollout.client import RolloutClient

    model_dir = push_model_dir(name)
    with console.status(f"weight pushes with the {name} model..."):
        port = free_port()
        proc = start_worker(args, str(model_dir), port, eager=True)
        client = RolloutClient([f"127.0.0.1:{port}"], timeout_s=900)
        try:
            timings = push_timings(args, client, model_dir)
            if "object_store" in args.sections.split(",") and name in OBJECT_STORE_MODELS:
                from benchmarks.ray_bytes import push_object_store_bytes

                # Versions far above the timed pushes': a replica takes only newer versions.
                timings["object_store"] = push_object_store_bytes(model_dir, f"127.0.0.1:{port}", first_version=10**6)
            return timings
        finally:
            client.close()
            proc.terminate()
            proc.wait(timeout=60)


def generation_section(args) -> dict:
    """The raw engine (child process) and a tiny-model rollout worker, alternated."""
    from benchmarks.rollout_worker import start_worker
    from rlep.common.ports import free_port
    from rlep.common.tiny_model import cached_model
    from rlep.services.rollout.client import RolloutClient

    cached_model("tiny")
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=raw_engine_serve, args=(args, child_conn))
    with console.status("starting the raw vLLM engine (child process)..."):
        child.start()
        conn.recv()
    with console.status("rollout service with the tiny model..."):
        port = free_port()
        proc = start_worker(args, "tiny", port)
        client = RolloutClient([f"127.0.0.1:{port}"], timeout_s=900)
        try:
            return generation_side_by_side(args, client, conn)
        finally:
            conn.send("stop")
            child.join()
            client.close()
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="skip torch.compile (faster start, slower decode)")
    parser.add_argument(
        "--sections",
        default="generation,push,object_store",
        help="comma-separated: generation, push, object_store (measured with the push section's workers)",
    )
    parser.add_argument("--push-models", default=",".join(PUSH_MODELS), help=f"comma-separated of {PUSH_MODELS}")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    sections = args.sections.split(",")
    known = {"generation", "push", "object_store"}
    unknown = set(sections) - known | set(args.push_models.split(",")) - set(PUSH_MODELS)
    if unknown:
        parser.error(f"unknown sections or push models: {sorted(unknown)}")

    results: dict = {}
    if "generation" in sections:
        results["generation"] = generation_section(args)
        report_generation(args, results["generation"])
    if "push" in sections:
        results["push"] = {name: push_section(args, name) for name in args.push_models.split(",")}
        report_pushes(results["push"])
        report_object_store(results["push"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def report_generation(args, results: dict) -> None:
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
    results["ratio"] = ratio
    console.print(
        f"generation ratio service/raw = [bold]{ratio:.3f}[/bold]"
        f" (goal >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})"
    )


def report_pushes(results: dict) -> None:
    pushes = Table(title="weight push vs safetensors save_file + load_file: median seconds (min-max), alternated")
    columns = ("model", "params", "stream", "shared_file", "raw save+load", "stream/raw", "shared/raw")
    for column in (*columns, "worker receive+check / load (stream; shared)"):
        pushes.add_column(column, justify="right")
    for name, p in results.items():
        p["stream_ratio"] = p["stream"] / p["raw_save_load"]
        p["shared_file_ratio"] = p["shared_file"] / p["raw_save_load"]
        pushes.add_row(
            name,
            f"{p['params'] / 1e6:.1f}M",
            *(
                f"{p[k]:.3f} ({p[k + '_spread'][0]:.2f}-{p[k + '_spread'][1]:.2f})"
                for k in ("stream", "shared_file", "raw_save_load")
            ),
            f"{p['stream_ratio']:.2f}",
            f"{p['shared_file_ratio']:.2f}",
            "; ".join(f"{p[f'{k}_worker_receive']:.3f} / {p[f'{k}_worker_load']:.3f}" for k in TRANSPORTS),
        )
    console.print(pushes)
    for name, p in results.items():
        if name == "tiny":
            continue  # a ~1 MB payload: per-call overhead, not the payload, sets that ratio
        worst = max(p["stream_ratio"], p["shared_file_ratio"])
        console.print(
            f"{name} push ratio (slower transport)/raw = [bold]{worst:.2f}[/bold]"
            f" (goal <= 2 for both: {'met' if worst <= 2 else 'NOT met'})"
        )


def report_object_store(results: dict) -> None:
    measured = {name: p["object_store"] for name, p in results.items() if "object_store" in p}
    if not measured:
        return
    table = Table(title="Ray object-store bytes per weight push (= per training step), median")
    for column in ("model", "weights", "driver-side push (before)", "learner-side push (now)"):
        table.add_column(column, justify="right")
    for name, o in measured.items():
        table.add_row(name, *(f"{o[k]:,}" for k in ("weight_bytes", "driver_side", "learner_side")))
    console.print(table)


if __name__ == "__main__":
    main()
