"""Issue 31's hostile-client campaign, re-run, and issue 46's: what each item that broke does now, against
`rlep serve` processes, the health port (`--health-port`) among them (`--only healthport`); and issue 50's hostile
tool code against the sandbox (`--only sandbox`).

Every service starts as an operator starts it (`rlep serve <svc>` on loopback, default settings, no auth; `mixed` and
`healthport` add `--health-port`, as compose and Helm do), and is
attacked as the issues' campaigns did (one module per service in `benchmarks/hostile/`). Per item it records what a
caller now gets (status codes, latencies of the other callers, recovery times, exit codes, resident memory); where an
item has bounds, its figures carry `bounds` and `met` (each figure at most its bound). The JSON goes to
`benchmarks/results/hostile_clients.json`, the table to the terminal (docs/limits.md quotes it). Rollout (items 1
and 8) starts vLLM: only with `--with-rollout`.

    python benchmarks/hostile_clients.py [--with-rollout] [--load-seconds 30] [--only PART ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from hostile.common import RLEP  # benchmarks/hostile/, beside this script
from hostile.eval import big_pages, eval_items
from hostile.health_port import health_port_items
from hostile.load import load
from hostile.mixed import mixed
from hostile.replay import replay_items
from hostile.rollout import rollout_items
from hostile.sandbox import sandbox_items
from hostile.verifier import scorer_items, verifier_items
from rich.console import Console
from rich.table import Table

RESULTS = Path("benchmarks/results/hostile_clients.json")


def cli_items(work: Path) -> dict:
    """Item 9: an empty token file."""
    empty = work / "empty-token"
    empty.write_text("")
    run = subprocess.run(
        [RLEP, "serve", "verifier", "--port", "0", "--auth-token-file", str(empty)], capture_output=True, text=True
    )
    return {"9 empty --auth-token-file": {"exit": run.returncode, "stderr_lines": len(run.stderr.strip().splitlines())}}


PARTS = {
    "replay": lambda work, args: replay_items(work),
    "verifier": lambda work, args: verifier_items(),
    "scorer": lambda work, args: scorer_items(),
    "eval": lambda work, args: eval_items(work),
    "pages": lambda work, args: big_pages(work),
    "cli": lambda work, args: cli_items(work),
    "rollout": lambda work, args: rollout_items(work),
    "load": lambda work, args: {"load": load(args.load_seconds, work)},
    "mixed": lambda work, args: mixed(work),
    "healthport": lambda work, args: health_port_items(work),
    "sandbox": lambda work, args: sandbox_items(work),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--with-rollout", action="store_true", help="also rollout's items 1 and 8 (starts vLLM)")
    parser.add_argument("--load-seconds", type=float, default=30.0, help="per load run (0 skips the load runs)")
    parser.add_argument("--only", action="append", choices=sorted(PARTS), help="re-run these parts, keep the rest")
    args = parser.parse_args()
    parts = args.only or [
        p for p in PARTS if (p != "rollout" or args.with_rollout) and (p != "load" or args.load_seconds)
    ]
    work = Path(tempfile.mkdtemp(prefix="rlep-hostile-"))
    results: dict = json.loads(RESULTS.read_text()) if args.only and RESULTS.exists() else {}
    try:
        for part in parts:
            started = os.getloadavg()
            results.update(PARTS[part](work, args))
            results.setdefault("load average (1 min) at start, end", {})[part] = [started[0], os.getloadavg()[0]]
    finally:  # the parts that ran are written even when a later one fails
        shutil.rmtree(work, ignore_errors=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1))
    table = Table(title="hostile clients (issues 31 and 46), measured now")
    table.add_column("item")
    table.add_column("what a caller gets now")
    for item, figures in results.items():
        table.add_row(item, json.dumps(figures))
    Console(width=200).print(table)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
