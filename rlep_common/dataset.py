"""Questions shared by every service: their identity (the same prompt always gets the same id), the
`Question` type, and the one reader of verl/DAPO parquet files (training, periodic eval, eval service,
collection).

`question_id` hashes the chat prompt's content only: the sequence of (role, normalised content)
pairs, as canonical JSON. Normalisation is Unicode NFC, then every run of whitespace collapsed to
one space and the ends stripped, so re-encoded or re-wrapped copies of one prompt keep their id.

Left out on purpose:
- `data_source`: real datasets relabel it (DAPO-Math-17k says `DAPO-17k`, RLEP's released pool
  says `dapo_math` for the same prompts), and a question must find its replayed successes under
  either label.
- `extra_info.index`: DAPO-Math-17k repeats some prompts under different indices, and one question
  should share one pool of successes however often it appears.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

QUESTION_ID_HEX_CHARS = 24  # 96 bits: collisions are negligible for any dataset size we meet
_WHITESPACE = re.compile(r"\s+")


def normalise_content(text: str) -> str:
    """NFC, whitespace runs collapsed to one space, ends stripped."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFC", str(text))).strip()


def question_id(prompt: Iterable[Mapping[str, str]]) -> str:
    """Stable id of a question from its chat prompt (a list of {"role", "content"})."""
    messages = [[str(m["role"]).strip().lower(), normalise_content(m["content"])] for m in prompt]
    canonical = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:QUESTION_ID_HEX_CHARS]


class DatasetError(ValueError):
    """A dataset that cannot be used; the message says which and why, by row (eval's API answers 422 with it)."""


@dataclass(frozen=True)
class Question:
    """One prompt with its gold answer, as every service takes it from a data set."""

    question_id: str  # `question_id(prompt)`, or the `extra_info.question_id` a file of ours carries
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs: the chat prompt
    ground_truth: str
    data_source: str = ""

    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def chat_question(prompt: Iterable[Mapping[str, str]], ground_truth: str, data_source: str = "") -> Question:
    """A question keyed by its prompt's content (`question_id`)."""
    messages = tuple((str(m["role"]), str(m["content"])) for m in prompt)
    return Question(question_id([{"role": r, "content": c} for r, c in messages]), messages, ground_truth, data_source)


def plain_answer(value: Any) -> str:
    """A gold answer as text; integral floats lose their `.0` (amc23 stores 27 as 27.0)."""
    if isinstance(value, bool):
        raise DatasetError(f"answer {value!r} is a boolean")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


VERL_COLUMNS = ("prompt", "reward_model")  # required; `data_source` and `extra_info` are read when present
_VERL_OPTIONAL = ("data_source", "extra_info")
_ROWS_PER_READ = 1024


def read_verl_parquet(path: Path | str, source: str | None = None, limit: int | None = None) -> list[Question]:
    """The questions of a verl/DAPO parquet file, in row order; reads the first `limit` rows only.

    A row is `prompt` (chat messages, or a string: one user message), `reward_model.ground_truth`,
    and optionally `data_source` and `extra_info.question_id` (kept as the id: files we exported).
    Refused with a `DatasetError` naming `source` (default: the path) and the row: an unreadable file
    or one without the two columns, an empty prompt or a message without role or content, and a
    missing or blank ground truth, and rows reusing an `extra_info.question_id` with another prompt or
    answer (`QuestionIdConflicts`).
    """
    import pyarrow.parquet as pq

    source = str(path) if source is None else source
    try:
        file, rows = pq.ParquetFile(path), []
        names = set(file.schema_arrow.names)
        missing = set(VERL_COLUMNS) - names
        if missing:  # iter_batches would leave them out without a word
            raise ValueError(f"no {', '.join(sorted(missing))} column")
        columns = [*VERL_COLUMNS, *(c for c in _VERL_OPTIONAL if c in names)]
        for batch in file.iter_batches(batch_size=_ROWS_PER_READ, columns=columns):
            rows.extend(batch.to_pylist())
            if limit is not None and len(rows) >= limit:
                break
    except Exception as err:  # pyarrow raises several types for unreadable files and missing columns
        raise DatasetError(f"{source}: not a verl parquet file with prompt and reward_model columns ({err})") from err
    questions = [_verl_question(row, source, index) for index, row in enumerate(rows[:limit])]
    conflicts = QuestionIdConflicts()
    for index, row in enumerate(rows[:limit]):
        conflicts.add(index, row, verl_prompt(row))
    if conflicts.count:
        raise DatasetError(f"{source}: {conflicts.describe()}")
    return questions


def verl_prompt(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """A verl row's chat prompt (some exports keep it as plain text: one user message)."""
    prompt = row.get("prompt") or []
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def verl_question_id(row: Mapping[str, Any], prompt: Iterable[Mapping[str, str]]) -> str:
    """A file of ours keeps the id it was exported with (`extra_info.question_id`); others get the prompt's."""
    extra = row.get("extra_info")
    kept_id = extra.get("question_id") if isinstance(extra, dict) else None
    return str(kept_id) if kept_id else question_id(prompt)


def _normalised_prompt(prompt: Iterable[Mapping[str, str]]) -> tuple[tuple[str, str], ...]:
    """The (role, content) pairs `question_id` hashes, without its sha256 and regex: 8x faster over a file."""

    def content(text: Any) -> str:
        text = str(text)
        return " ".join(
            (text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)).split()
        )

    return tuple((str(m["role"]).strip().lower(), content(m["content"])) for m in prompt)


class QuestionIdConflicts:
    """Rows that reuse a kept `extra_info.question_id` with another prompt or gold answer.

    Such rows would merge under one id, and the later row's answers would be stored as successes of the
    earlier one's question (or the reverse). Ids hashed from the prompt are not compared: DAPO-Math-17k
    repeats a prompt with two gold answers, and those rows already share their id by design. Memory: two
    ints per kept id (~100 bytes; ~100 MB for a million rows).
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int, int]] = {}  # hash(id) -> (row, hash(prompt id), hash(answer))
        self.count = 0
        self._first = ""

    def add(self, row_index: int, row: Mapping[str, Any], prompt: Iterable[Mapping[str, str]]) -> None:
        extra = row.get("extra_info")
        kept_id = extra.get("question_id") if isinstance(extra, dict) else None
        if not kept_id:
            return
        reward_model = row.get("reward_model")
        answer = str(reward_model.get("ground_truth") if isinstance(reward_model, dict) else "").strip()
        mine = (row_index, hash(_normalised_prompt(prompt)), hash(answer))
        earlier = self._seen.setdefault(hash(str(kept_id)), mine)
        if earlier[1:] == mine[1:]:
            return
        self.count += 1
        if not self._first:
            what = "prompt" if earlier[1] != mine[1] else "ground truth"
            self._first = f"row {row_index} has the question_id {kept_id} of row {earlier[0]} with another {what}"

    def describe(self) -> str:
        return (
            f"{self.count} rows reuse an earlier row's extra_info.question_id with another prompt or ground truth "
            f"(first: {self._first}); give each question its own id, or drop the id to key rows by prompt"
        )


def _verl_question(row: dict[str, Any], source: str, index: int) -> Question:
    prompt, reward_model = verl_prompt(row), row["reward_model"]
    if not prompt or not all(isinstance(m, dict) and m.get("role") and m.get("content") for m in prompt):
        raise DatasetError(f"{source}: row {index}: prompt must be a non-empty list of {{role, content}}")
    gold = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if gold is None or not str(gold).strip():
        raise DatasetError(f"{source}: row {index}: reward_model.ground_truth is missing")
    try:
        answer = plain_answer(gold)
    except DatasetError as err:
        raise DatasetError(f"{source}: row {index}: {err}") from err
    question = chat_question(prompt, answer, row.get("data_source") or "")
    return replace(question, question_id=verl_question_id(row, prompt))
