"""Which sampled responses a step logs for a person to read, and how (issue 32, item 6)."""

from __future__ import annotations

import json

from rlep.common.types import FinishReason, Source, Trajectory, Verdict
from rlep.services.learner.generation_log import RESPONSE_CHARS, append_jsonl, markdown_table, pick


def sample(qid: str, i: int, **fields) -> Trajectory:
    return Trajectory(qid, f"{qid} answer {i}", reward=1.0 if i % 2 else -1.0, verdict=Verdict.WRONG, **fields)


def test_different_questions_come_before_more_samples_of_one():
    groups = [[sample("a", 0), sample("a", 1)], [sample("b", 0)], [sample("c", 0), sample("c", 1)]]
    picked = pick(7, ["A?", "B?", "C?"], groups, 4)
    assert [(r.question_id, r.response) for r in picked] == [
        ("a", "a answer 0"), ("b", "b answer 0"), ("c", "c answer 0"), ("a", "a answer 1"),
    ]  # fmt: skip
    assert picked[0].step == 7 and picked[0].question == "A?" and picked[0].verdict == "WRONG"
    assert pick(7, ["A?"], [[sample("a", 0)]], 0) == []


def test_a_step_that_replayed_shows_one_replayed_row_last():
    replayed = sample("b", 9, source=Source.REPLAY)
    groups = [[sample("a", 0), sample("a", 1)], [sample("b", 0), replayed]]
    picked = pick(3, ["A?", "B?"], groups, 3)
    assert [(r.response, r.source) for r in picked] == [
        ("a answer 0", "fresh"), ("b answer 0", "fresh"), ("b answer 9", "replay"),
    ]  # fmt: skip
    assert picked[-1].question == "B?"


def test_a_replayed_row_says_so_and_a_long_response_is_cut(tmp_path):
    long = Trajectory(
        "q", "x" * (RESPONSE_CHARS + 10), reward=1.0, source=Source.REPLAY, finish_reason=FinishReason.LENGTH
    )
    [row] = pick(1, ["Q?"], [[long]], 1)
    assert row.source == "replay" and row.finish_reason == "LENGTH"
    assert row.response.endswith("[…10 more characters]") and len(row.response) < RESPONSE_CHARS + 40
    path = tmp_path / "generations.jsonl"
    append_jsonl(path, [row])
    append_jsonl(path, pick(2, ["a|b\nc"], [[sample("q", 1)]], 1))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and lines[1]["reward"] == 1.0
    table = markdown_table(pick(2, ["a|b\nc"], [[sample("q", 1)]], 1))
    assert "| fresh | +1.00 | WRONG | STOP | a\\|b<br>c | q answer 1 |" in table
