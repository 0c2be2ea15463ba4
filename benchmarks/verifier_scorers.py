"""Items/s of the countdown Python scorer against math-verify, through the verifier service (docs/rewards.md).

A real verifier (2 workers, verdict cache off) on loopback; 2,000 distinct items per call, half right, each
scorer timed twice after a warm-up call, each call on items it has not seen (math-verify's parser keeps caches of
its own in the worker processes: the same items again run several times faster). Needs no data set.

    python benchmarks/verifier_scorers.py
"""

from __future__ import annotations

import random
import time

from rlep.common.config import ServerConfig
from rlep.common.types import Verdict
from rlep.services.verifier.client import ScoredItem, VerifierClient
from rlep.services.verifier.config import VerifierConfig
from rlep.services.verifier.countdown import countdown_rows
from rlep.services.verifier.main import start_verifier

ITEMS = 2000


def countdown_items(seed: int) -> list[ScoredItem]:
    rows = countdown_rows(ITEMS, seed=seed)
    answers = [r["extra_info"]["solution"] if i % 2 else "1 + 2" for i, r in enumerate(rows)]
    return [
        ScoredItem(f"<think>...</think><answer>{a}</answer>", r["reward_model"]["ground_truth"], "countdown")
        for a, r in zip(answers, rows, strict=True)
    ]


def math_items(seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    items = []
    for i in range(ITEMS):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        items.append((f"so the answer is \\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a}/{b}" if i % 2 else f"{a + 1}/{b}"))
    return items


def main() -> None:
    scorers = {"countdown": {"type": "python", "function": "rlep.services.verifier.countdown:score"}}
    config = VerifierConfig(server=ServerConfig(port=0), num_workers=2, verdict_cache_size=0, scorers=scorers)
    running = start_verifier(config)
    try:
        with VerifierClient(f"127.0.0.1:{running.port}") as client:
            makers = {"countdown": countdown_items, "math": math_items}
            for make in makers.values():
                client.verify(make(0)[:50])
            for name, items in [(name, make(seed)) for seed in (1, 2) for name, make in makers.items()]:
                started = time.perf_counter()
                outcomes = client.verify(items)
                seconds = time.perf_counter() - started
                correct = sum(o.verdict == Verdict.CORRECT for o in outcomes)
                print(f"{name}: {len(items) / seconds:.0f} items/s ({seconds:.2f} s, {correct} correct)")
    finally:
        running.stop()


if __name__ == "__main__":
    main()
