"""Rich tables of the named endpoints and the decision (`endpoints`, `decision`), which the report prints first."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from rlep.experiments.protocol.endpoints import DIFFERENT, LATE_FRACTION, PRIMARY, SAME, UNRECORDED


def _pp(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.1f}"


def _row_cells(row: dict) -> list[str]:
    """diff (pp), t95, bootstrap 95%, p; the primary interval first (t for n <= 10)."""
    if not row.get("n"):
        return ["n/a", "", "", ""]
    if row["n"] == 1:
        return [_pp(row["diff"]), "1 seed: no interval", "", ""]
    t = f"[{_pp(row['t_low'])}, {_pp(row['t_high'])}]" + (" (primary)" if row["method"] == "t" else "")
    boot = f"[{_pp(row['boot_low'])}, {_pp(row['boot_high'])}]" + (" (primary)" if row["method"] != "t" else "")
    return [_pp(row["diff"]), t, boot, "—" if row["p"] is None else f"{row['p']:.3f}"]


def pairing_line(result: dict) -> str:
    pairs = result["pairing"]
    line = f"{len(pairs[SAME])} same CPU, {len(pairs[UNRECORDED])} CPU not recorded (unverified)"
    if pairs[DIFFERENT]:
        line += f", {len(pairs[DIFFERENT])} on different CPUs (seeds {pairs[DIFFERENT]}: left out, listed unpaired)"
    return line


def print_endpoints(label: str, result: dict, decision: dict, console: Console) -> None:
    """One arm's endpoints against the baseline, in pp, and the pre-registered decision under them."""
    h, (lo, hi) = result["horizon"], result["early_window"]
    table = Table(
        title=f"{label} - baseline, named endpoints on a fixed horizon of {h} steps (every run cut there), "
        f"held-out accuracy in pp; pairs: {pairing_line(result)}"
    )
    for column in ("endpoint", "baseline", "RLEP", "difference (pp)", "t95, df = n-1", "percentile bootstrap 95%"):
        table.add_column(column, justify="right")
    for column in ("paired t p", "n"):
        table.add_column(column, justify="right")
    names = {"early gain": f"early gain (steps {lo}-{hi}, primary: faster climb)"}
    names["plateau"] = "plateau (last 5 evaluations, primary: decides)"
    for name, row in result["endpoints"].items():
        means = [f"{row['baseline_mean']:.3f}", f"{row['arm_mean']:.3f}"] if row.get("n") else ["", ""]
        table.add_row(names.get(name, name), *means, *_row_cells(row), str(row.get("n", 0)))
    console.print(table)
    for seed, values in result["unpaired"].items():
        console.print(
            f"unpaired (different CPUs), seed {seed}: "
            + "; ".join(f"{name} {b:.3f} / {a:.3f}" for name, (b, a) in values.items())
        )
    rescues = result["late_rescues"]
    late = "not recorded" if rescues["mean"] is None else f"{rescues['mean']:.2f} per step ({rescues['seeds']} seeds)"
    console.print(f"late rescues (steps {h - round(h * LATE_FRACTION) + 1}-{h}): {late}")
    console.print(f"[bold]decision (issue 49's pre-registered rule): {decision['verdict']}[/bold] — {decision['why']}")


def print_ablation_endpoints(result: dict, console: Console) -> None:
    """The exploratory cells' primary endpoints with Holm-adjusted p across the cells."""
    table = Table(
        title=f"ablations, EXPLORATORY: primary endpoints on a fixed horizon of {result['horizon']} steps, pp, "
        "t95 \\[primary] boot(bootstrap 95%), paired t p / Holm-adjusted p across the cells"
    )
    for column in ("cell", "pairs", *PRIMARY, "late rescues / step"):
        table.add_column(column, justify="right")
    rows = {"RLEP as run (reference, outside the Holm family)": result["reference"], **result["cells"]}
    for name, cell in rows.items():
        cells = []
        for endpoint in PRIMARY:
            row = cell["endpoints"][endpoint]
            diff, t, boot, p = _row_cells(row)
            holm = row.get("p_holm")
            adjusted = "" if holm is None else f" / {holm:.3f}"
            cells.append(
                f"{diff} {t.replace(' (primary)', '')} {boot.replace('[', '(').replace(']', ')')} p {p}{adjusted}"
            )
        rescues = cell["late_rescues"]["mean"]
        table.add_row(name, pairing_line(cell), *cells, "—" if rescues is None else f"{rescues:.2f}")
    console.print(table)
