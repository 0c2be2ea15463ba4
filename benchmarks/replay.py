"""Replay sampling: one training step's Sample through the service vs the same reads with redis-py.

Fills a pool with Q questions x S successes (~1 KB responses) through the service (measuring add
throughput), then for each of --steps steps draws 512 random questions and samples M=2 each,
interleaved step by step in one run:
(a) through the gRPC service as the typed client asks for it (`trajectories_as_bytes`: each
trajectory arrives as its stored bytes; the reply is parsed, the trajectories are not),
(b) the same RPC in the message form older clients ask for (the service parses and re-encodes
every trajectory; the reply is parsed into messages), and
(c) directly with redis-py pipelines doing the same reads (count per question, the chosen index's
id, its payload, as raw bytes).
The typed client's whole step (RPC + conversion into dataclasses) and the conversion alone are
timed separately. Prints trajectories/s of (a) and (c), their ratio (goal >= 0.8) and the
service's p50/p99 step latency (goal p99 <= 20 ms on loopback) for (a) and (b).

    python benchmarks/replay.py [--questions 17000] [--per-question 8] [--steps 200]
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
FILLER = "Let x be the unknown. Expanding both sides and collecting terms gives a quadratic in x. "


def make_batch(questions: range, per_question: int):
    from rlep.common.types import Trajectory, Verdict

    return [
        Trajectory(
            f"q{q}",
            f"[{q}.{k}] " + FILLER * 11 + f"\\boxed{{{q + k}}}",
            1.0,
            verdict=Verdict.CORRECT,
            policy_version=k % 3,
            response_token_ids=tuple(range(k, k + 64)),
        )
        for q in questions
        for k in range(per_question)
    ]


def raw_sample(client, prefix: str, question_ids: list[str], m: int, seed: int) -> int:
    """The same reads as the service, with plain redis-py pipelines; returns trajectories read."""
    from rlep.services.replay.sampling import choose_uniform_indices, question_stream_seed

    pipe = client.pipeline(transaction=False)
    for qid in question_ids:
        pipe.zcount(f"{prefix}:q:{qid}:ver", 0, "+inf")
    counts = pipe.execute()
    pipe = client.pipeline(transaction=False)
    picks = []
    for qid, n in zip(question_ids, counts, strict=True):
        for index in choose_uniform_indices(int(n), m, question_stream_seed(seed, qid)):
            pipe.zrange(f"{prefix}:q:{qid}:ver", index, index)
            picks.append(qid)
    ids = pipe.execute()
    pipe = client.pipeline(transaction=False)
    for qid, found in zip(picks, ids, strict=True):
        pipe.hget(f"{prefix}:q:{qid}:data", found[0])
    return sum(p is not None for p in pipe.execute())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=17_000)
    parser.add_argument("--per-question", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--m", type=int, default=2)
    args = parser.parse_args()

    import redis

    from rlep.common.config import ServerConfig
    from rlep.common.redis_server import start_local_redis
    from rlep.replay.v1 import replay_pb2
    from rlep.services.replay.client import ReplayClient, sampled_trajectories
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.replay.main import start_replay
    from rlep.services.replay.store import pool_prefix

    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        local = start_local_redis(Path(tmp), appendfsync="everysec")
        running = start_replay(ReplayConfig(server=ServerConfig(port=0), redis_url=local.url))
        raw = redis.Redis.from_url(local.url)
        try:
            with ReplayClient(f"127.0.0.1:{running.port}") as client:
                added, add_seconds = 0, 0.0
                batch_questions = max(1, 4096 // args.per_question)
                with Progress(console=console) as progress:
                    task = progress.add_task("filling the pool", total=args.questions)
                    for start in range(0, args.questions, batch_questions):
                        chunk = range(start, min(start + batch_questions, args.questions))
                        batch = make_batch(chunk, args.per_question)
                        started = time.perf_counter()
                        added += client.add("bench", batch).added
                        add_seconds += time.perf_counter() - started
                        progress.advance(task, len(chunk))
                rng = random.Random(0)
                service_s, raw_s, latencies, legacy, typed, convert = 0.0, 0.0, [], [], [], []
                service_n = raw_n = 0
                for step in range(args.steps + 5):
                    qids = [f"q{q}" for q in rng.sample(range(args.questions), STEP_QUESTIONS)]
                    request = replay_pb2.SampleRequest(pool="bench", question_ids=qids, m=args.m, seed=step)
                    # The first read of a step's keys is the slower one (cold caches): the two reply forms
                    # take turns going first.
                    for as_bytes in (True, False) if step % 2 else (False, True):
                        request.trajectories_as_bytes = as_bytes
                        started = time.perf_counter()
                        answer = client.stub.Sample(request, timeout=30)
                        if as_bytes:
                            reply, elapsed = answer, time.perf_counter() - started
                        else:
                            legacy_elapsed = time.perf_counter() - started
                    started = time.perf_counter()
                    client.sample("bench", qids, args.m, seed=step)
                    typed_elapsed = time.perf_counter() - started
                    started = time.perf_counter()
                    {s.question_id: sampled_trajectories(s) for s in reply.samples}
                    convert_elapsed = time.perf_counter() - started
                    started = time.perf_counter()
                    raw_count = raw_sample(raw, pool_prefix("bench"), qids, args.m, seed=step)
                    raw_elapsed = time.perf_counter() - started
                    if step >= 5:  # warm-up steps are not counted
                        latencies.append(elapsed)
                        legacy.append(legacy_elapsed)
                        typed.append(typed_elapsed)
                        convert.append(convert_elapsed)
                        service_s += elapsed
                        raw_s += raw_elapsed
                        service_n += sum(len(s.trajectory_bytes) for s in reply.samples)
                        raw_n += raw_count
        finally:
            running.stop()
            local.stop()
    service_rate, raw_rate = service_n / service_s, raw_n / raw_s
    p50, p99 = percentile_ms(latencies, 50), percentile_ms(latencies, 99)
    legacy_p50, legacy_p99 = percentile_ms(legacy, 50), percentile_ms(legacy, 99)
    table = Table(
        title=f"replay: {args.questions} questions x {args.per_question}, steps of {STEP_QUESTIONS} x M={args.m}"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("add throughput (service)", f"{added / add_seconds:,.0f} trajectories/s")
    table.add_row("sample throughput, service (bytes replies)", f"{service_rate:,.0f} trajectories/s")
    table.add_row("sample throughput, raw redis-py", f"{raw_rate:,.0f} trajectories/s")
    table.add_row("ratio service / raw  [goal >= 0.8]", f"{service_rate / raw_rate:.3f}")
    table.add_row("step latency p50 / p99, bytes replies  [goal p99 <= 20 ms]", f"{p50:.1f} / {p99:.1f} ms")
    table.add_row("step latency p50 / p99, message replies (older clients)", f"{legacy_p50:.1f} / {legacy_p99:.1f} ms")
    table.add_row("typed client step (RPC + dataclasses), p50", f"{percentile_ms(typed, 50):.1f} ms")
    table.add_row("typed client conversion alone (bytes -> dataclasses), p50", f"{percentile_ms(convert, 50):.1f} ms")
    console.print(table)
    print(
        json.dumps(
            {
                "add_per_s": added / add_seconds,
                "service_per_s": service_rate,
                "raw_per_s": raw_rate,
                "ratio": service_rate / raw_rate,
                "p50_ms": p50,
                "p99_ms": p99,
                "legacy_p50_ms": legacy_p50,
                "legacy_p99_ms": legacy_p99,
                "typed_p50_ms": percentile_ms(typed, 50),
                "convert_p50_ms": percentile_ms(convert, 50),
            }
        )
    )


def percentile_ms(seconds: list[float], q: int) -> float:
    """The q-th percentile (1..99) in milliseconds; q=50 is the median."""
    return statistics.quantiles(seconds, n=100)[q - 1] * 1000


if __name__ == "__main__":
    main()
