"""Does a verdict depend on machine load? The same slow-but-legal item, checked N times, quiet vs loaded.

The item (the sum of 1/n^2 against pi^2/6) takes ~0.6-1.0 s of CPU in math-verify's comparison, close
to the default 1 s limit of one math-verify step. A limit counted in wall time turns it into TIMEOUT as
soon as other processes take CPU from the worker; a limit counted in the worker's CPU time does not.
"Load" is 2 x cores busy-loop processes running beside the verifier for the whole loaded run.

Prints, per condition, the verdict counts and how many verdicts differ from the quiet run's majority.

    python benchmarks/verifier_load.py [--repeats 20] [--workers 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import time

ITEM = ("\\boxed{\\sum_{n=1}^{\\infty} \\frac{1}{n^2}}", "\\frac{\\pi^2}{6}")


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def run(repeats: int, workers: int, loaded: bool) -> dict[str, int]:
    from rlep.services.verifier.judge import CheckOptions
    from rlep.services.verifier.pool import VerifyPool

    pool = VerifyPool(num_workers=workers, item_timeout_s=30.0, options=CheckOptions(parse_timeout_s=1))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,)) for _ in range(2 * (os.cpu_count() or 1) if loaded else 0)]
    try:
        for proc in spinners:
            proc.start()
        results = pool.verify([ITEM] * repeats)
        return dict(collections.Counter(r.verdict.value for r in results))
    finally:
        stop.set()
        for proc in spinners:
            proc.join()
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    quiet = run(args.repeats, args.workers, loaded=False)
    loaded = run(args.repeats, args.workers, loaded=True)
    majority = max(quiet, key=quiet.get)
    report = {
        "repeats": args.repeats,
        "workers": args.workers,
        "load_average_1m": os.getloadavg()[0],
        "quiet": quiet,
        "loaded": loaded,
        "quiet_changed": args.repeats - quiet.get(majority, 0),
        "loaded_changed": args.repeats - loaded.get(majority, 0),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
