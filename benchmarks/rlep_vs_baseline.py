"""RLEP vs the M=0 baseline over several seeds: the demo's protocol repeated, mean ± spread of its figures.

Each seed runs `rlep demo` end to end (warm-up, baseline, collection, RLEP) into <out>/seed<k>/ and
this script tabulates: the baseline's peak accuracy and the step it was reached, the steps RLEP
needed to reach that peak, both final accuracies, and both mean step times.

    python benchmarks/rlep_vs_baseline.py [--seeds 0 1 2] [--out rlep-bench] [--set steps=40 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {sd:.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("rlep-bench"))
    parser.add_argument("--set", dest="sets", action="append", default=[], help="DemoConfig override, key=value")
    args = parser.parse_args()

    from rlep.services.demo.runner import load_demo_config, run_demo

    results = []
    for seed in args.seeds:
        out = args.out / f"seed{seed}"
        if (out / "results.json").exists():  # finished earlier: reuse (delete the folder to rerun)
            results.append(json.loads((out / "results.json").read_text()))
            continue
        results.append(run_demo(load_demo_config(sets=args.sets, flags={"seed": seed, "out_dir": out})))

    def column(key: str) -> list[float]:
        return [float(r[key]) for r in results if r.get(key) is not None]

    reached = [r["rlep_steps_to_baseline_peak"] for r in results]
    table = Table(title=f"RLEP vs baseline over seeds {args.seeds}")
    table.add_column("figure")
    table.add_column("mean ± sd (min, max)", justify="right")
    table.add_row("baseline peak accuracy", spread(column("baseline_peak")))
    table.add_row("baseline: step of its peak", spread(column("baseline_peak_step")))
    table.add_row(
        "RLEP: steps to the baseline's peak",
        spread([float(r) for r in reached if r is not None]) + f"  [reached in {sum(r is not None for r in reached)}"
        f"/{len(reached)} seeds]",
    )
    table.add_row("RLEP peak accuracy", spread(column("rlep_peak")))
    table.add_row("baseline final accuracy", spread(column("baseline_final")))
    table.add_row("RLEP final accuracy", spread(column("rlep_final")))
    table.add_row("baseline step time (s)", spread(column("baseline_step_seconds")))
    table.add_row("RLEP step time (s)", spread(column("rlep_step_seconds")))
    console = Console()
    console.print(table)

    # Seeds start from different warm-up models, so the spread above is mostly theirs; what replay
    # changes shows in the paired differences (same seed, same warm-up model, same evaluation).
    paired = Table(title="paired per seed: RLEP minus baseline")
    for name in ("seed", "warm-up pass@1", "steps saved to baseline peak", "peak diff", "final diff"):
        paired.add_column(name, justify="right")
    for r in results:
        reached = r["rlep_steps_to_baseline_peak"]
        saved = "not reached" if reached is None else str(r["baseline_peak_step"] - reached)
        paired.add_row(
            str(r["seed"]),
            f"{r['warmup_pass_at_1']:.3f}",
            saved,
            f"{r['rlep_peak'] - r['baseline_peak']:+.3f}",
            f"{r['rlep_final'] - r['baseline_final']:+.3f}",
        )
    console.print(paired)
    (args.out / "summary.json").write_text(json.dumps({"seeds": args.seeds, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
