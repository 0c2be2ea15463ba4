"""Per-question history's cost: one training step's ReportOutcomes + Sample against today's Sample alone.

Fills a pool with Q questions x S successes (~300-byte responses) and gives every question a history (reports of
`max_outcomes_per_report` questions), then for each of --steps steps draws 512 random questions and, interleaved
in one run (the two take turns going first):
(a) today: the typed client's Sample of M=2 per question;
(b) with history: the same Sample, then a ReportOutcomes of the step's 512 outcomes (a new step each time).
Prints p50/p99 of each and of the report alone, and the ratio of (b) to (a) (the issue's goal: <= 1.2x). Redis
runs with the shipped default `appendfsync always` (a report is a write: it waits for its fsync) unless
--appendfsync says otherwise. The default run (10^5 questions, 200 steps) takes about two minutes on 2 cores.

    python benchmarks/replay_history.py [--questions 100000] [--per-question 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

STEP_QUESTIONS = 512
FILLER = "Expanding both sides and collecting terms gives a quadratic in x. "


def fill(client, pool: str, questions: int, per_question: int, report_chunk: int, progress: Progress) -> int:
    """Fills the pool, then a history per question; returns the Redis memory the histories took, in bytes."""
    from rlep.common.types import Trajectory, Verdict
    from rlep.replay.v1 import replay_pb2

    batch = max(1, 4096 // per_question)
    task = progress.add_task("filling the pool", total=questions)
    for start in range(0, questions, batch):
        chunk = range(start, min(start + batch, questions))
        rows = [
            Trajectory(f"q{q}", f"[{q}.{k}] " + FILLER * 4 + f"\\boxed{{{q + k}}}", 1.0, verdict=Verdict.CORRECT)
            for q in chunk
            for k in range(per_question)
        ]
        client.add(pool, rows)
        progress.advance(task, len(chunk))
    before = client.stats(pool).redis_used_memory_bytes
    task = progress.add_task("a history for every question", total=questions)
    for start in range(0, questions, report_chunk):
        chunk = range(start, min(start + report_chunk, questions))
        outcomes = [replay_pb2.QuestionOutcome(question_id=f"q{q}", attempts=8, successes=q % 9) for q in chunk]
        client.report_outcomes(pool, "fill", start, 0, outcomes)
        progress.advance(task, len(chunk))
    return client.stats(pool).redis_used_memory_bytes - before


def step_outcomes(rng: random.Random, qids: list[str], m: int):
    from rlep.replay.v1 import replay_pb2

    outcomes = []
    for qid in qids:
        successes = rng.choice((0, 0, 2, 5, 8))
        outcomes.append(
            replay_pb2.QuestionOutcome(
                question_id=qid,
                attempts=8,
                successes=successes,
                mean_reward=(2 * successes - 8) / 8,
                replayed=m,
                rescued=successes == 0,
            )
        )
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=100_000)
    parser.add_argument("--per-question", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--m", type=int, default=2)
    parser.add_argument("--appendfsync", choices=("always", "everysec"), default="always")
    args = parser.parse_args()

    from rlep.common.config import ServerConfig
    from rlep.common.redis_server import start_local_redis
    from rlep.services.replay.client import ReplayClient
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.replay.main import start_replay

    console = Console()
    config = ReplayConfig(server=ServerConfig(port=0))
    sample_only, sample_then_report, report_only = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        local = start_local_redis(Path(tmp), appendfsync=args.appendfsync)
        running = start_replay(ReplayConfig(server=ServerConfig(port=0), redis_url=local.url))
        try:
            with ReplayClient(f"127.0.0.1:{running.port}") as client, Progress(console=console) as progress:
                history_bytes = fill(
                    client, "bench", args.questions, args.per_question, config.max_outcomes_per_report, progress
                )
                rng = random.Random(0)
                task = progress.add_task("steps", total=args.steps + 5)
                for step in range(args.steps + 5):
                    qids = [f"q{q}" for q in rng.sample(range(args.questions), STEP_QUESTIONS)]
                    outcomes = step_outcomes(rng, qids, args.m)
                    timings = {}
                    for with_report in (True, False) if step % 2 else (False, True):
                        started = time.perf_counter()
                        client.sample("bench", qids, args.m, seed=step)
                        sampled = time.perf_counter()
                        if with_report:
                            client.report_outcomes("bench", "bench-run", step, step, outcomes)
                        timings[with_report] = (sampled - started, time.perf_counter() - started)
                    if step >= 5:  # warm-up steps are not counted
                        sample_only.append(timings[False][0])
                        sample_then_report.append(timings[True][1])
                        report_only.append(timings[True][1] - timings[True][0])
                    progress.advance(task)
                stats = client.stats("bench")
        finally:
            running.stop()
            local.stop()
    with_history = stats.questions_with_history
    print_table(console, args, sample_only, sample_then_report, report_only, with_history, history_bytes)


def print_table(
    console: Console, args, sample_only, sample_then_report, report_only, with_history: int, history_bytes: int
) -> None:
    ratio_mean = statistics.fmean(sample_then_report) / statistics.fmean(sample_only)
    ratio_p99 = percentile_ms(sample_then_report, 99) / percentile_ms(sample_only, 99)
    table = Table(
        title=f"replay history: {args.questions:,} questions x {args.per_question} ({with_history:,} with history), "
        f"steps of {STEP_QUESTIONS} x M={args.m}, appendfsync {args.appendfsync}"
    )
    for column in ("per step", "p50 ms", "p99 ms", "mean ms"):
        table.add_column(column, justify="left" if column == "per step" else "right")
    for label, values in (
        ("(a) Sample alone (today)", sample_only),
        ("(b) Sample + ReportOutcomes", sample_then_report),
        ("    ReportOutcomes alone", report_only),
    ):
        table.add_row(
            label,
            f"{percentile_ms(values, 50):.1f}",
            f"{percentile_ms(values, 99):.1f}",
            f"{statistics.fmean(values) * 1000:.1f}",
        )
    table.add_row("ratio (b) / (a)  [goal <= 1.2]", "", f"{ratio_p99:.2f}", f"{ratio_mean:.2f}")
    console.print(table)
    console.print(f"Redis memory of the histories: {history_bytes / with_history:.0f} bytes per question")
    figures = {
        "sample_p50_ms": percentile_ms(sample_only, 50),
        "sample_p99_ms": percentile_ms(sample_only, 99),
        "with_report_p50_ms": percentile_ms(sample_then_report, 50),
        "with_report_p99_ms": percentile_ms(sample_then_report, 99),
        "report_p50_ms": percentile_ms(report_only, 50),
        "report_p99_ms": percentile_ms(report_only, 99),
        "ratio_mean": ratio_mean,
        "ratio_p99": ratio_p99,
        "history_bytes_per_question": history_bytes / with_history,
    }
    print(json.dumps(figures))


def percentile_ms(seconds: list[float], q: int) -> float:
    """The q-th percentile (1..99) in milliseconds; q=50 is the median."""
    return statistics.quantiles(seconds, n=100)[q - 1] * 1000


if __name__ == "__main__":
    main()
