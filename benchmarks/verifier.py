"""Verifier throughput: the gRPC service with W workers vs math-verify in a plain process on one core.

Every side checks the same responses: real worked solutions from MATH-500 and AIME 2024 (each with
its final \\boxed{} answer), half paired with their own gold answer and half with another question's.
Each gold answer appears once per run, so math-verify's gold-parse cache helps neither side. Every
checker (the single-core process, each plain process, each service worker) is a fresh process
that first checks the same warm-up items: sympy's first calls in a process are ~1.5x slower, and
sympy caches expressions, so a process that has seen the items before would look faster.

Prints items/s (median of --repeats runs) and the ratio service / (W x single-core); the goal is
>= 0.9 for W = cores. For context it also measures W plain processes side by side with no
service at all, each looping over its share.

    python benchmarks/verifier.py [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

Items = list[tuple[str, str]]


def load_items(seed: int = 0) -> Items:
    """One item per question: its own solution for even rows, another question's for odd rows."""
    rows = []
    for name in ("math500", "aime24"):
        for line in (DATA / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.append((row["solution"], str(row["answer"])))
    rng = random.Random(seed)
    items = [(solution if i % 2 == 0 else rng.choice(rows)[0], gold) for i, (solution, gold) in enumerate(rows)]
    rng.shuffle(items)  # wrong pairs cost ~2x right ones: mix them so every share gets its part
    return items


WARMUP_ITEMS = 150


def _timed_share(share: Items, warmup: Items, barrier, results) -> None:
    from rlep.services.verifier.core import check_answer, clear_gold_cache

    for response, gold in warmup:
        check_answer(response, gold)
    clear_gold_cache()
    barrier.wait()  # every process starts its share at the same moment
    started = time.perf_counter()
    for response, gold in share:
        check_answer(response, gold)
    results.put(time.perf_counter() - started)


def processes_rate(items: Items, warmup: Items, workers: int) -> float:
    """W fresh plain processes, each warmed up and then looping over its share: no service at all.

    W = 1 is the single-core reference. It runs in a fresh process too: sympy caches every
    expression it builds, so a process that has seen the items before would look faster.
    """
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=_timed_share, args=(items[i::workers], warmup, barrier, results)) for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    elapsed = max(results.get() for _ in procs)
    for proc in procs:
        proc.join()
    return len(items) / elapsed


def service_rate(items: Items, warmup: Items, workers: int) -> float:
    from rlep.common.config import ServerConfig
    from rlep.services.verifier.client import VerifierClient
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.main import start_verifier

    running = start_verifier(VerifierConfig(server=ServerConfig(port=0), num_workers=workers))
    try:
        with VerifierClient(f"127.0.0.1:{running.port}") as client:
            client.verify(list(warmup) * workers)  # each worker sees (most of) the warm-up items
            started = time.perf_counter()
            client.verify(items)
            return len(items) / (time.perf_counter() - started)
    finally:
        running.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    console = Console()
    everything = load_items()
    warmup, items = everything[:WARMUP_ITEMS], everything[WARMUP_ITEMS:]
    rates: dict[str, list[float]] = {"single": [], "parallel": [], "service": []}
    for run in range(args.repeats):
        with console.status(f"run {run + 1}/{args.repeats}: one plain process"):
            rates["single"].append(processes_rate(items, warmup, 1))
        with console.status(f"run {run + 1}/{args.repeats}: {args.workers} plain processes"):
            rates["parallel"].append(processes_rate(items, warmup, args.workers))
        with console.status(f"run {run + 1}/{args.repeats}: service with {args.workers} workers"):
            rates["service"].append(service_rate(items, warmup, args.workers))
    single, parallel, service = (statistics.median(rates[k]) for k in ("single", "parallel", "service"))
    ratio = service / (args.workers * single)
    table = Table(
        title=f"verifier throughput: {len(items)} responses, median of {args.repeats}, {os.cpu_count()} cores"
    )
    table.add_column("path")
    table.add_column("items/s", justify="right")
    table.add_row("math-verify in one plain process (1 core)", f"{single:.1f}")
    table.add_row(f"{args.workers} plain processes side by side", f"{parallel:.1f}")
    table.add_row(f"gRPC service, {args.workers} workers", f"{service:.1f}")
    table.add_row("ratio service / (W x single)  [goal >= 0.9]", f"{ratio:.3f}")
    table.add_row("ratio service / plain processes", f"{service / parallel:.3f}")
    console.print(table)
    print(
        json.dumps(
            {
                "workers": args.workers,
                "single_core_items_per_s": single,
                "parallel_items_per_s": parallel,
                "service_items_per_s": service,
                "ratio_vs_w_single": ratio,
                "ratio_vs_parallel": service / parallel,
            }
        )
    )


if __name__ == "__main__":
    main()
