"""`verify_groups`: every group's responses go to the verifier in one call, and the outcomes come back grouped as
given (the learner's fresh and replayed answers, phase 1's samples and eval's completions all go through it)."""

from __future__ import annotations

from rlep.common.types import Verdict
from rlep.services.verifier.client import VerifyOutcome, verify_groups


class RecordingVerifier:
    """Judges a response right when it equals the ground truth; records each call's items."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str]]] = []

    def verify(self, items):
        self.calls.append(list(items))
        return [VerifyOutcome(float(r == g), Verdict.CORRECT if r == g else Verdict.WRONG, r, 0.0) for r, g in items]


def test_outcomes_come_back_grouped_from_one_call():
    verifier = RecordingVerifier()
    groups = [("4", ["4", "5"]), ("7", []), ("1", ["1", "1", "2"])]
    outcomes = verify_groups(verifier, groups)
    assert verifier.calls == [[("4", "4"), ("5", "4"), ("1", "1"), ("1", "1"), ("2", "1")]]
    assert [[o.extracted_answer for o in group] for group in outcomes] == [["4", "5"], [], ["1", "1", "2"]]
    assert [[o.verdict for o in group] for group in outcomes][2] == [Verdict.CORRECT, Verdict.CORRECT, Verdict.WRONG]
