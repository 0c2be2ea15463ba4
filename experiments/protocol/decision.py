"""Issue 49's pre-registered decision rule: does replay's higher plateau (the paper's "ends higher") transfer?

Read on the `plateau` endpoint (`endpoints`: mean of the last 5 evaluations on a fixed horizon, RLEP - baseline,
paired over seeds) with its Student t 95% interval, and on late rescues (groups per step replay still gives its
only gradient over the horizon's last third):
- **transfers**: plateau difference >= +1.5 pp, its t95 lower bound > 0, and late rescues >= 1 per step;
- **does not transfer**: late rescues >= 1 per step (replay had something left to teach) but the t95 upper bound
  < +1.5 pp (a gain of the size sought is excluded);
- **undecided** otherwise: in particular when late rescues are below 1 per step, the plateau was not tested: the
  policy had memorised its training questions and replay had nothing left to add (issue 29's miniature, ~30 visits
  per question against the paper's ~11).
The thresholds are constants here so that the rule cannot drift with the data; tests/unit/test_protocol_decision.py
pins them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PLATEAU_MARGIN = 0.015
"""The plateau gain sought: +1.5 pp of held-out accuracy (1.5 evaluation standard errors at 2,500 questions)."""
MIN_LATE_RESCUES = 1.0
"""Rescued groups per step, late in the run, for the plateau to count as tested (the issue's stage-1 gate too)."""
TRANSFERS, DOES_NOT_TRANSFER, UNDECIDED = "transfers", "does not transfer", "undecided"


@dataclass(frozen=True)
class Decision:
    verdict: str
    """TRANSFERS, DOES_NOT_TRANSFER or UNDECIDED."""
    why: str

    def to_json(self) -> dict:
        return asdict(self)


def decide(plateau: dict, late_rescues: float | None) -> Decision:
    """The rule on one arm: `plateau` is the endpoint row (diff, t_low, t_high, n), `late_rescues` the mean rescued
    groups per step late in the runs (None: not recorded)."""
    if plateau.get("n", 0) < 2:
        return Decision(UNDECIDED, "fewer than 2 paired seeds: no interval")
    diff, low, high = plateau["diff"], plateau["t_low"], plateau["t_high"]
    figures = f"plateau {diff * 100:+.1f} pp, t95 [{low * 100:+.1f}, {high * 100:+.1f}] over {plateau['n']} seeds"
    if late_rescues is None:
        return Decision(UNDECIDED, f"{figures}; late rescues not recorded, so the plateau cannot count as tested")
    rescues = f"late rescues {late_rescues:.2f} per step"
    if late_rescues < MIN_LATE_RESCUES:
        return Decision(
            UNDECIDED,
            f"{figures}; {rescues} (< {MIN_LATE_RESCUES:g}): replay had nothing left to teach late, so the plateau was "
            "not tested at the paper's visit count",
        )
    if diff >= PLATEAU_MARGIN and low > 0:
        return Decision(TRANSFERS, f"{figures}; {rescues}")
    if high < PLATEAU_MARGIN:
        return Decision(DOES_NOT_TRANSFER, f"{figures} excludes +{PLATEAU_MARGIN * 100:g} pp; {rescues}")
    return Decision(UNDECIDED, f"{figures}: neither clears +{PLATEAU_MARGIN * 100:g} pp nor excludes it; {rescues}")
