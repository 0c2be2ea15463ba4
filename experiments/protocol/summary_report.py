"""A summary JSON (the report's `.json`) reported again with today's statistics: the named endpoints, the decision
and the paired figures with t intervals, for the runs it holds (`run --endpoints-of PATH`). Issue 15's runs were
never archived; their curves live only in `results/issue15.json`. Writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rlep.experiments.protocol.decision import decide
from rlep.experiments.protocol.endpoint_tables import print_endpoints
from rlep.experiments.protocol.endpoints import arm_endpoints
from rlep.experiments.protocol.figures import paired, run_figures
from rlep.experiments.protocol.report import _ci


def report_summary(path: Path, console: Console) -> dict:
    """Prints, per arm of the summary's runs, its endpoints, decision and paired figures; returns
    {arm: {"endpoints", "decision", "paired"}}."""
    runs = json.loads(path.read_text())["runs"]
    baseline = {int(s): run for s, run in runs["baseline"].items()}
    out = {}
    for arm, by_seed in runs.items():
        if arm == "baseline":
            continue
        arm_runs = {int(s): run for s, run in by_seed.items()}
        result = arm_endpoints(baseline, arm_runs)
        decision = decide(result["endpoints"]["plateau"], result["late_rescues"]["mean"]).to_json()
        print_endpoints(f"{path.name}: {arm}", result, decision, console)
        figures = paired([run_figures(baseline[s], arm_runs[s]) for s in sorted(arm_runs)])
        table = Table(title=f"{path.name}: {arm} - baseline, each seed to its own stop, mean t\\[95%] boot(95%)")
        for column in ("figure", "difference", "n"):
            table.add_column(column, justify="right")
        for name, row in figures.items():
            if row.get("n") and "median" not in row:
                table.add_row(name, _ci(row, 2 if row.get("ratio") else 3), str(row["n"]))
        console.print(table)
        out[arm] = {"endpoints": result, "decision": decision, "paired": figures}
    return out
