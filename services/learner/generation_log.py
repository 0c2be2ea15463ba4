"""A few of each step's sampled responses, for a person to read (issue 32, item 6): what verl's
`log_val_generations` and TRL's completions table give. Each step's record names the step; its generations go to
`<run dir>/generations.jsonl` (one line per response) and to TensorBoard as text (`generations`), as a table.

Which ones: `logging.generations_per_step` responses, the first fresh sample of the step's first questions, then
their second samples, and so on (different questions before more of one question); when the step replayed answers,
the last of them is a replayed row (what the policy was shown, not what it wrote, and it says so).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rlep.common.types import Source, Trajectory

RESPONSE_CHARS = 4000  # a response longer than this is cut (marked) in the log: the log is for reading


@dataclass(frozen=True)
class LoggedGeneration:
    step: int
    question_id: str
    question: str
    response: str
    reward: float
    verdict: str
    finish_reason: str
    source: str  # "fresh" or "replay"
    policy_version: int


def pick(
    step: int, questions: Sequence[str], groups: Sequence[Sequence[Trajectory]], count: int
) -> list[LoggedGeneration]:
    """`count` responses of `groups` (one group per question, in `questions` order): fresh sample 0 of each
    question, then sample 1 of each, ...; the last one replayed when any row is."""
    if count == 0:
        return []
    fresh = [[t for t in g if t.source != Source.REPLAY] for g in groups]
    replayed = [(q, t) for q, g in zip(questions, groups, strict=True) for t in g if t.source == Source.REPLAY]
    if not replayed:
        return _breadth_first(step, questions, fresh, count)
    return [*_breadth_first(step, questions, fresh, count - 1), logged(step, *replayed[0])]


def _breadth_first(
    step: int, questions: Sequence[str], groups: Sequence[Sequence[Trajectory]], count: int
) -> list[LoggedGeneration]:
    picked: list[LoggedGeneration] = []
    depth = max((len(g) for g in groups), default=0)
    for index in range(depth):
        for question, group in zip(questions, groups, strict=True):
            if len(picked) == count:
                return picked
            if index < len(group):
                picked.append(logged(step, question, group[index]))
    return picked


def logged(step: int, question: str, t: Trajectory) -> LoggedGeneration:
    response = t.response_text
    if len(response) > RESPONSE_CHARS:
        response = response[:RESPONSE_CHARS] + f" […{len(t.response_text) - RESPONSE_CHARS} more characters]"
    return LoggedGeneration(
        step=step,
        question_id=t.question_id,
        question=question,
        response=response,
        reward=t.reward,
        verdict=t.verdict.name if t.verdict is not None else "",
        finish_reason=t.finish_reason.name,
        source="replay" if t.source == Source.REPLAY else "fresh",
        policy_version=t.policy_version,
    )


def append_jsonl(path: Path, rows: Sequence[LoggedGeneration]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(asdict(row), ensure_ascii=False) + "\n")


def markdown_table(rows: Sequence[LoggedGeneration]) -> str:
    """The rows as a Markdown table (TensorBoard renders its text summaries as Markdown)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| source | reward | verdict | finish | question | response |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r.source} | {r.reward:+.2f} | {r.verdict} | {r.finish_reason} | {cell(r.question)} | {cell(r.response)} |"
        for r in rows
    ]
    return "\n".join(lines)
