"""Verifier throughput: the gRPC service with W workers vs plain math-verify in one and in W processes.

Two workloads, both built from real MATH-500 and AIME 2024 worked solutions (each ends in \\boxed{}):
- `distinct`: one item per question, half paired with its own gold answer and half with another
  question's, shuffled. Little repeats (326 distinct gold answers among 530), so caches barely help:
  this is what the service costs or saves on work it cannot skip.
- `rl`: RL-shaped. Per question G sampled responses (default 16) share the question's gold answer;
  each group has its own accuracy (uniform in [0, 1]); correct samples box the solution's own final
  answer (a fifth write the gold answer's form instead); wrong samples box one of 1-4 distractors
  (other questions' answers, Zipf-weighted, so several samples share a wrong answer); 1 in 16 is cut
  off before its answer. Groups are sent together, as a trainer sends a step's batch.

Baselines are what a user of plain math-verify runs: `check_answer` with no cache of ours (its gold
answer is parsed for every item; math-verify's own small LRU of 20 parsed strings still applies), in
one process, and in W processes side by side each looping over a contiguous share (contiguous keeps a
question's group in one process: the split most favourable to them). Every checker is a fresh process
warmed up on the same items first (sympy's first calls in a process are ~1.5x slower).

Prints items/s (median of --repeats runs), service / (W x single) [goal >= 0.9], service / (W plain
processes), the service's cache hit rates, and the box's scaling: W plain math-verify processes vs
one, beside W processes of a pure-Python loop, which says whether the cores themselves scale; then
where the ceiling comes from: W plain processes each checking ALL the items side by side (CPU per item
vs alone: do the cores slow each other?), the CPU seconds W processes spend on their shares over one
process's on all items (the work splitting adds), and how uneven the static split is.

    python benchmarks/verifier.py [--workers 2] [--repeats 3] [--rl-questions 96] [--group-size 16]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
WARMUP_QUESTIONS = 150

Items = list[tuple[str, str]]


def load_rows() -> list[tuple[str, str]]:
    """(solution, gold answer) of every MATH-500 and AIME 2024 question, in a fixed shuffled order."""
    rows = []
    for name in ("math500", "aime24"):
        for line in (DATA / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.append((row["solution"], str(row["answer"])))
    random.Random(0).shuffle(rows)
    return rows


def distinct_items(rows: list[tuple[str, str]], seed: int = 0) -> Items:
    """One item per question: its own solution for even rows, another question's for odd rows."""
    rng = random.Random(seed)
    items = [(solution if i % 2 == 0 else rng.choice(rows)[0], gold) for i, (solution, gold) in enumerate(rows)]
    rng.shuffle(items)  # wrong pairs cost ~2x right ones: mix them so every share gets its part
    return items


def _boxed_content(solution: str) -> tuple[str, str]:
    """(text before the last \\boxed, its content) of a worked solution."""
    from rlep.common.answers import extract_boxed

    return solution[: solution.rfind("\\boxed")], extract_boxed(solution) or ""


def rl_items(rows: list[tuple[str, str]], questions: int, group_size: int, seed: int = 0) -> Items:
    """G responses per question, group after group (see the module docstring for their make-up)."""
    rng = random.Random(seed)
    golds = [gold for _, gold in rows]
    items: Items = []
    for solution, gold in rows[:questions]:
        prefix, own = _boxed_content(solution)
        accuracy = rng.random()
        distractors = [a for a in rng.sample(golds, 8) if a != gold][: rng.randint(1, 4)] or ["0"]
        weights = [1 / (rank + 1) for rank in range(len(distractors))]
        for sample in range(group_size):
            head = f"(sample {sample}) {prefix}"
            if rng.random() < 1 / 16:
                items.append((head, gold))  # cut off before its final answer
            elif rng.random() < accuracy:
                answer = gold if rng.random() < 0.2 else own
                items.append((f"{head}\\boxed{{{answer}}}.", gold))
            else:
                items.append((f"{head}\\boxed{{{rng.choices(distractors, weights)[0]}}}.", gold))
    return items


def _timed_share(share: Items, warmup: Items, barrier, results) -> None:
    from rlep.services.verifier.judge import check_answer

    logging.disable(logging.WARNING)  # math-verify's one-time "Timeout is disabled" notice: we limit CPU time

    for response, gold in warmup:
        check_answer(response, gold)
    barrier.wait()  # every process starts its share at the same moment
    started, cpu_started = time.perf_counter(), time.process_time()
    for response, gold in share:
        check_answer(response, gold)  # plain: no cache of ours
    results.put((time.perf_counter() - started, time.process_time() - cpu_started))


def processes_rate(items: Items, warmup: Items, workers: int, split: bool = True) -> tuple[float, list[float]]:
    """W fresh plain processes, each warmed up and then looping over its contiguous share: no service.

    Returns items/s and each process's CPU seconds. `split=False` gives every process all the items
    (same work in each, run side by side): its items/s counts W x the items.
    """
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    bounds = [len(items) * i // workers for i in range(workers + 1)]
    shares = [items[bounds[i] : bounds[i + 1]] if split else items for i in range(workers)]
    procs = [ctx.Process(target=_timed_share, args=(share, warmup, barrier, results)) for share in shares]
    for proc in procs:
        proc.start()
    times = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    return sum(map(len, shares)) / max(wall for wall, _ in times), [cpu for _, cpu in times]


def service_rate(items: Items, warmup: Items, workers: int) -> tuple[float, dict[str, float]]:
    """The gRPC service (default config: caches on), warmed up, then one call with every item."""
    from rlep.common.config import ServerConfig
    from rlep.services.verifier.client import VerifierClient
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.main import start_verifier

    running = start_verifier(VerifierConfig(server=ServerConfig(port=0), num_workers=workers))
    try:
        with VerifierClient(f"127.0.0.1:{running.port}") as client:
            client.verify(warmup)  # each worker gets the warm-up items of the gold answers it owns
            before = running.pool.counts()
            started = time.perf_counter()
            client.verify(items)
            rate = len(items) / (time.perf_counter() - started)
            after = running.pool.counts()
    finally:
        running.stop()
    work = {k: after[k] - before[k] for k in ("checked", "decided", "cached", "joined")}
    gold_parsed = sum(after["gold_parsed_by_worker"]) - sum(before["gold_parsed_by_worker"])
    return rate, {
        "verdict_hit_rate": (work["cached"] + work["joined"]) / len(items),
        "checked_fraction": work["checked"] / len(items),
        "gold_parse_hit_rate": 1 - gold_parsed / max(1, work["checked"]),
    }


def _spin(n: int, barrier, results) -> None:
    barrier.wait()
    started = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i % 7
    results.put(time.perf_counter() - started)


def cpu_scaling(workers: int, n: int = 3_000_000) -> float:
    """Throughput of W processes running a pure-Python loop over one such process (W = perfect scaling)."""
    ctx = mp.get_context("spawn")
    rates = []
    for count in (1, workers):
        barrier, results = ctx.Barrier(count), ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(n, barrier, results)) for _ in range(count)]
        for proc in procs:
            proc.start()
        elapsed = max(results.get() for _ in procs)
        for proc in procs:
            proc.join()
        rates.append(count * n / elapsed)
    return rates[1] / rates[0]


def measure(name: str, items: Items, warmup: Items, workers: int, repeats: int, console: Console) -> dict:
    rates: dict[str, list[float]] = {"single": [], "parallel": [], "service": [], "same_work": []}
    ceiling: dict[str, list[float]] = {"split_cpu": [], "imbalance": [], "same_work_cpu": []}
    hits: list[dict[str, float]] = []
    for run in range(repeats):
        with console.status(f"{name} run {run + 1}/{repeats}: one plain process"):
            rate, (single_cpu,) = processes_rate(items, warmup, 1)
            rates["single"].append(rate)
        with console.status(f"{name} run {run + 1}/{repeats}: {workers} plain processes"):
            rate, cpus = processes_rate(items, warmup, workers)
            rates["parallel"].append(rate)
            ceiling["split_cpu"].append(sum(cpus) / single_cpu)  # work added by splitting the items
            ceiling["imbalance"].append(max(cpus) / statistics.mean(cpus))
        with console.status(f"{name} run {run + 1}/{repeats}: {workers} plain processes, all items each"):
            rate, cpus = processes_rate(items, warmup, workers, split=False)
            rates["same_work"].append(rate)
            ceiling["same_work_cpu"].append(statistics.mean(cpus) / single_cpu)  # the cores slowing each other
        with console.status(f"{name} run {run + 1}/{repeats}: service with {workers} workers"):
            rate, rates_of_hits = service_rate(items, warmup, workers)
            rates["service"].append(rate)
            hits.append(rates_of_hits)
    single, parallel, service = (statistics.median(rates[k]) for k in ("single", "parallel", "service"))
    return {
        "workload": name,
        "items": len(items),
        "single_items_per_s": single,
        "parallel_items_per_s": parallel,
        "service_items_per_s": service,
        "ratio_vs_w_single": service / (workers * single),
        "ratio_vs_parallel": service / parallel,
        "parallel_scaling": parallel / single,
        "same_work_scaling": statistics.median(rates["same_work"]) / single,
        **{k: statistics.median(v) for k, v in ceiling.items()},
        **{k: statistics.median(h[k] for h in hits) for k in hits[0]},
    }


def print_ceiling(results: list[dict], w: int, loop_scaling: float, console: Console) -> None:
    """Where svc/(W x 1) stops: the cores (same work side by side) vs the work that splitting the items adds."""
    table = Table(
        title=f"where the ceiling comes from (plain math-verify; pure-Python loop: {w} processes = "
        f"{loop_scaling:.2f} x 1)"
    )
    for column in (
        "workload",
        f"{w} plain split / 1",
        f"{w} plain, all items each / 1",
        "CPU s/item side by side / alone",
        f"CPU s of {w} shares / of 1 process",
        "slowest share CPU / mean",
        "bound: (all-each / W) / split CPU",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["workload"],
            f"{r['parallel_scaling']:.2f}",
            f"{r['same_work_scaling']:.2f}",
            f"{r['same_work_cpu']:.3f}",
            f"{r['split_cpu']:.3f}",
            f"{r['imbalance']:.3f}",
            f"{r['same_work_scaling'] / w / r['split_cpu']:.3f}",
        )
    console.print(table)
    console.print(
        "Side by side on the same items the cores scale (CPU s/item ~1.0); split across processes the items cost "
        "more CPU in total (per-process state, e.g. sympy's and math-verify's caches, warms on fewer items; "
        "SYMPY_USE_CACHE=no alone does not remove it), and a static split is uneven. Goal: svc/(W x 1) >= 0.9."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rl-questions", type=int, default=96)
    parser.add_argument("--group-size", type=int, default=16)
    args = parser.parse_args()
    console = Console(width=160)
    rows = load_rows()
    warmup_rows, rows = rows[:WARMUP_QUESTIONS], rows[WARMUP_QUESTIONS:]
    warmup = distinct_items(warmup_rows, seed=1)
    rl = rl_items(rows, args.rl_questions, args.group_size)
    results = [
        measure("distinct", distinct_items(rows), warmup, args.workers, args.repeats, console),
        measure(f"rl (G={args.group_size})", rl, warmup, args.workers, args.repeats, console),
    ]
    with console.status("pure-Python loop: 1 vs W processes"):
        loop_scaling = statistics.median(cpu_scaling(args.workers) for _ in range(args.repeats))
    w = args.workers
    table = Table(title=f"verifier throughput, items/s: median of {args.repeats}, W={w}, {os.cpu_count()} cores")
    for column in ("workload", "items", "1 plain", f"{w} plain", f"service {w}w", "svc/(W x 1)", "svc/plain"):
        table.add_column(column, justify="right")
    table.add_column("verdict cache hits", justify="right")
    table.add_column("gold parse hits", justify="right")
    for r in results:
        table.add_row(
            r["workload"],
            str(r["items"]),
            f"{r['single_items_per_s']:.1f}",
            f"{r['parallel_items_per_s']:.1f}",
            f"{r['service_items_per_s']:.1f}",
            f"{r['ratio_vs_w_single']:.3f}",
            f"{r['ratio_vs_parallel']:.3f}",
            f"{r['verdict_hit_rate']:.1%}",
            f"{r['gold_parse_hit_rate']:.1%}",
        )
    console.print(table)
    print_ceiling(results, w, loop_scaling, console)
    print(json.dumps({"workers": w, "loop_scaling": loop_scaling, "results": results}))


if __name__ == "__main__":
    main()
