"""Issue 49's named endpoints and pre-registered rule (rlep.experiments.protocol.endpoints, decision): early gain
and plateau on one fixed horizon, pairs on different CPUs left out, Holm across ablation cells, the rule's
thresholds, and what the report prints from the committed archive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from rlep.experiments.protocol import decision as rule
from rlep.experiments.protocol.decision import decide
from rlep.experiments.protocol.endpoint_tables import print_endpoints
from rlep.experiments.protocol.endpoints import (
    DIFFERENT,
    SAME,
    UNRECORDED,
    ablation_endpoints,
    arm_endpoints,
    cpu_model,
    late_rescues,
    plateau,
)

EPYC = "AMD EPYC (family 26 model 2, {mhz} MHz), 2 cores"
ARCHIVE = Path(__file__).resolve().parents[2] / "experiments" / "protocol" / "results" / "archive" / "results"


def plateau_row(diff, low, high, n=5):
    return {"diff": diff, "t_low": low, "t_high": high, "n": n}


def test_the_rules_thresholds_are_the_registered_ones():
    """Changing the rule must fail here: the margin and the rescue threshold were named before the runs."""
    assert rule.PLATEAU_MARGIN == 0.015 and rule.MIN_LATE_RESCUES == 1.0


@pytest.mark.parametrize(
    ("plateau", "rescues", "verdict"),
    [
        (plateau_row(0.015, 0.001, 0.029), 1.0, rule.TRANSFERS),  # every bound met exactly
        (plateau_row(0.0149, 0.001, 0.029), 1.0, rule.UNDECIDED),  # the gain falls short of +1.5 pp
        (plateau_row(0.02, 0.0, 0.04), 1.0, rule.UNDECIDED),  # the lower bound touches 0
        (plateau_row(0.02, 0.005, 0.035), 0.99, rule.UNDECIDED),  # a gain, but replay had nothing left late
        (plateau_row(0.02, 0.005, 0.035), None, rule.UNDECIDED),  # rescues not recorded
        (plateau_row(0.003, -0.007, 0.0149), 1.0, rule.DOES_NOT_TRANSFER),  # +1.5 pp excluded with rescues present
        (plateau_row(0.003, -0.007, 0.015), 1.0, rule.UNDECIDED),  # the upper bound reaches +1.5 pp
        (plateau_row(0.003, -0.007, 0.013), 0.05, rule.UNDECIDED),  # issue 29's archive: rescues absent
        (plateau_row(0.05, 0.04, 0.06, n=1), 5.0, rule.UNDECIDED),  # one seed: no interval
    ],
)
def test_the_decision_rule(plateau, rescues, verdict):
    assert decide(plateau, rescues).verdict == verdict


def run(curve, machine=None, rescues=None):
    out = {"curve": [list(point) for point in curve]}
    if machine:
        out["machine"] = machine
    if rescues is not None:
        out["replay_signal_groups"] = rescues
    return out


def test_endpoints_are_read_on_one_fixed_horizon():
    # Seed 0 ran 120 steps, seed 1 ran 60: every run is cut at 60; early window (0, 20], plateau = last 5 <= 60.
    steps = range(0, 130, 10)
    base = {0: run([(s, 0.2 + s / 1000) for s in steps]), 1: run([(s, 0.2 + s / 1000) for s in steps if s <= 60])}
    arm = {0: run([(s, 0.3 + s / 1000) for s in steps]), 1: run([(s, 0.25 + s / 1000) for s in steps if s <= 60])}
    out = arm_endpoints(base, arm)
    assert out["horizon"] == 60 and out["early_window"] == [0, 20]
    early, plat = out["endpoints"]["early gain"], out["endpoints"]["plateau"]
    assert early["per_seed"] == pytest.approx({0: 0.1, 1: 0.05}) and early["n"] == 2
    assert plateau(base[0], 60) == pytest.approx(0.2 + 0.04)  # steps 20..60, not seed 0's 80..120
    assert plat["baseline_mean"] == pytest.approx(0.24) and plat["diff"] == pytest.approx(0.075)
    own = out["endpoints"]["plateau at each seed's own end (secondary)"]
    assert own["per_seed"][0] == pytest.approx(0.1) and own["baseline_mean"] == pytest.approx((0.3 + 0.24) / 2)
    with pytest.raises(ValueError, match="needs 5"):
        plateau(base[1], 30)


def test_a_pair_on_different_cpus_is_left_out_of_the_interval_and_listed_unpaired():
    assert (
        cpu_model(EPYC.format(mhz=2596)) == cpu_model(EPYC.format(mhz=2445)) == "AMD EPYC (family 26 model 2), 2 cores"
    )
    assert cpu_model(None) is None
    curve = [(s, 0.2 + s / 1000) for s in range(0, 110, 10)]
    better = [(s, a + 0.01) for s, a in curve]
    intel = "Intel(R) Xeon(R) Processor (family 6 model 207, 2300 MHz), 2 cores"
    base = {0: run(curve, EPYC.format(mhz=2596)), 1: run(curve, EPYC.format(mhz=2596)), 2: run(curve)}
    arm = {0: run(better, EPYC.format(mhz=2600)), 1: run(better, intel), 2: run(better, intel)}
    out = arm_endpoints(base, arm)
    assert out["pairing"] == {SAME: [0], UNRECORDED: [2], DIFFERENT: [1]}
    assert out["endpoints"]["plateau"]["n"] == 2 and set(out["endpoints"]["plateau"]["per_seed"]) == {0, 2}
    assert out["unpaired"][1]["plateau"] == pytest.approx((0.28, 0.29))


def test_late_rescues_are_the_last_third_of_the_horizon():
    # Steps 1..90: 1.0 rescued group per step up to step 60, 0.1 after; a baseline records none.
    groups = [1.0] * 60 + [0.1] * 30 + [5.0] * 30  # steps past the horizon do not count
    assert late_rescues({"replay_signal_groups": groups}, 90) == pytest.approx(0.1)
    assert late_rescues({"replay_signal_groups": [None] * 90}, 90) is None
    assert late_rescues({}, 90) is None


def test_ablation_cells_are_holm_corrected_across_cells_and_the_reference_stays_outside():
    curve = [(s, 0.2 + s / 1000) for s in range(0, 110, 10)]
    shifted = [[(s, a + d) for s, a in curve] for d in (0.010, 0.012, 0.011, 0.001, -0.002, 0.003, 0.02, 0.021, 0.025)]
    base = {s: run(curve) for s in range(3)}
    cells = {"clear": {s: run(shifted[s]) for s in range(3)}, "noise": {s: run(shifted[3 + s]) for s in range(3)}}
    out = ablation_endpoints(base, cells, {s: run(shifted[6 + s]) for s in range(3)})
    clear, noise = (out["cells"][name]["endpoints"]["plateau"] for name in ("clear", "noise"))
    assert clear["p_holm"] == pytest.approx(2 * clear["p"])  # the smaller p of two, times 2
    assert noise["p_holm"] == pytest.approx(max(noise["p"], 2 * clear["p"]))
    assert "p_holm" not in out["reference"]["endpoints"]["plateau"]


def archived(name):
    return json.loads((ARCHIVE / f"{name}.json").read_text())


def test_the_archive_reads_undecided_with_the_early_gain_docs_results_md_leads_with():
    """docs/results.md's headline, recomputed from the committed archive: must change when the data or rule do."""
    base = {s: archived(f"baseline-s{s}") for s in range(5)}
    out = arm_endpoints(base, {s: archived(f"rlep-s{s}") for s in range(5)})
    early, plat = out["endpoints"]["early gain"], out["endpoints"]["plateau"]
    assert out["horizon"] == 400 and early["method"] == "t"
    assert (early["diff"], early["t_low"], early["t_high"]) == pytest.approx((0.0447, 0.0353, 0.0540), abs=5e-4)
    assert (plat["diff"], plat["t_low"], plat["t_high"]) == pytest.approx((0.0029, -0.0074, 0.0133), abs=5e-4)
    assert out["late_rescues"]["seeds"] == 3 and out["late_rescues"]["mean"] < 0.1  # seeds 2-4 record it
    verdict = decide(plat, out["late_rescues"]["mean"])
    assert verdict.verdict == rule.UNDECIDED and "not tested" in verdict.why
    console = Console(record=True, width=250)
    print_endpoints("RLEP", out, verdict.to_json(), console)
    text = console.export_text()
    assert "decision (issue 49's pre-registered rule): undecided" in text and "+4.5" in text and "[+3.5, +5.4]" in text
