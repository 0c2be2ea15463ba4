"""Per-question history in a pool file (`pool_parquet`): the `rlep_history` column and the history-only part.

A pool file written by this version carries, beside RLEP's released columns:
- `rlep_history`: a struct per row, the row's question history (null where it has none). Its fields are the
  stored fields of `rlep.replay.v1.QuestionHistory` (derived ones, the pass rate and mastered, are recomputed on
  import), so verl readers that take the columns they know read the file as before.
- the history of questions with no success, which have no row (a row needs candidates, and often has no prompt
  to give: a report carries none), as an Arrow IPC table in the file's key-value metadata under
  `rlep.history_only` (columns `question_id`, `question`: the serialized Question or null, `rlep_history`),
  at most `MAX_HISTORY_ONLY_BYTES`.
- `rlep.history_schema` = `HISTORY_SCHEMA` in the key-value metadata. A file with a later schema is refused;
  a file without the key (the released format, and files written before history existed) imports as it always did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
from google.protobuf.message import DecodeError

from rlep.replay.v1 import replay_pb2

HISTORY_SCHEMA = b"1"
SCHEMA_KEY = b"rlep.history_schema"
HISTORY_ONLY_KEY = b"rlep.history_only"
# Parquet readers load the whole footer; pyarrow refuses one over 100 MB. ~200 bytes a question: ~250k questions.
MAX_HISTORY_ONLY_BYTES = 48 * 1024 * 1024

_COUNTS = (
    "visits",
    "attempts",
    "successes",
    "first_step",
    "last_step",
    "first_policy_version",
    "last_policy_version",
    "times_replayed",
    "replayed_rows",
    "times_rescued",
    "last_solved_step",
)
HISTORY_TYPE = pa.struct(
    [(name, pa.int64()) for name in _COUNTS]
    + [
        ("reward_sum", pa.float64()),
        ("ema_pass_rate", pa.float64()),
        ("window_attempts", pa.list_(pa.int32())),
        ("window_successes", pa.list_(pa.int32())),
    ]
)
HISTORY_ONLY_SCHEMA = pa.schema(
    [("question_id", pa.string()), ("question", pa.binary()), ("rlep_history", HISTORY_TYPE)]
)


class HistoryFileError(ValueError):
    """History in a pool file that this version cannot read: nothing of the file is imported."""


def history_to_row(history: replay_pb2.QuestionHistory) -> dict[str, Any]:
    return {name: getattr(history, name) for name in HISTORY_TYPE.names} | {
        "window_attempts": list(history.window_attempts),
        "window_successes": list(history.window_successes),
    }


def history_from_row(question_id: str, row: Mapping[str, Any]) -> replay_pb2.QuestionHistory:
    """The history a row's `rlep_history` holds (the service checks its values when it is imported)."""
    history = replay_pb2.QuestionHistory(question_id=question_id)
    for name in HISTORY_TYPE.names:
        value = row.get(name)
        if name.startswith("window_"):
            getattr(history, name).extend(value or [])
        elif value is not None:
            setattr(history, name, value)
    return history


def check_history_schema(metadata: Mapping[bytes, bytes] | None, schema: pa.Schema) -> str | None:
    """Why the file's history cannot be read by this version, or None (also for a file without history)."""
    version = (metadata or {}).get(SCHEMA_KEY)
    if version is not None and version != HISTORY_SCHEMA:
        return (
            f"its history is schema {version.decode(errors='replace')}, this version reads {HISTORY_SCHEMA.decode()}: "
            "import it with a newer rlep"
        )
    if "rlep_history" in schema.names and not _fits(schema.field("rlep_history").type):
        return f"`rlep_history` is {schema.field('rlep_history').type}, not {HISTORY_TYPE}"
    return None


def _fits(kind: pa.DataType) -> bool:
    return pa.types.is_struct(kind) and all(kind.get_field_index(name) >= 0 for name in HISTORY_TYPE.names)


def history_only_bytes(rows: Sequence[tuple[str, bytes | None, replay_pb2.QuestionHistory]]) -> bytes:
    """The history-only part as Arrow IPC bytes; HistoryFileError past MAX_HISTORY_ONLY_BYTES."""
    table = pa.Table.from_pylist(
        [{"question_id": q, "question": meta, "rlep_history": history_to_row(h)} for q, meta, h in rows],
        schema=HISTORY_ONLY_SCHEMA,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, HISTORY_ONLY_SCHEMA) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    if len(data) > MAX_HISTORY_ONLY_BYTES:
        raise HistoryFileError(
            f"{len(rows)} questions have history and no success: {len(data):,} bytes, over the "
            f"{MAX_HISTORY_ONLY_BYTES:,} a pool file's metadata holds"
        )
    return data


def read_history_only(
    metadata: Mapping[bytes, bytes] | None,
) -> list[tuple[replay_pb2.Question | None, replay_pb2.QuestionHistory]]:
    """The history-only part of a file (empty without one): each question's stored Question (or None) and history.

    Raises HistoryFileError when the part does not parse or has other columns.
    """
    data = (metadata or {}).get(HISTORY_ONLY_KEY)
    if not data:
        return []
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except pa.ArrowException as err:
        raise HistoryFileError(f"its history-only part does not parse ({err})") from err
    if not table.schema.equals(HISTORY_ONLY_SCHEMA):
        raise HistoryFileError(f"its history-only part has columns {table.schema}, not {HISTORY_ONLY_SCHEMA}")
    out = []
    for row in table.to_pylist():
        try:
            question = replay_pb2.Question.FromString(row["question"]) if row["question"] else None
        except DecodeError as err:
            raise HistoryFileError(f"its history-only part holds a question that does not parse ({err})") from err
        if question is not None and question.question_id != row["question_id"]:
            raise HistoryFileError(f"its history-only part pairs {row['question_id']!r} with another question")
        out.append((question, history_from_row(row["question_id"], row["rlep_history"] or {})))
    return out
