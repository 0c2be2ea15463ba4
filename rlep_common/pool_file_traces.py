"""Tool traces in a pool file (`pool_parquet`; issue 50): the `rlep_traces` column.

A multi-turn tool trace is kept whole: its token ids, its loss mask (which tokens the tool wrote), its calls and its
environment's hashes, as a serialized `rlep.common.v1.Trajectory` per trace, in a list per row (null where the
row's question has none). Traces are not among `reward_model.candidates`: a verl reader, or an older rlep, would
take a trace's text, tool outputs included, for an answer the policy wrote and train on it. A row may then hold
traces and no candidate.

`rlep.traces_schema` = `TRACES_SCHEMA` in the key-value metadata. A file with a later schema is refused; a file
without the column (the released format, and files written before traces) imports as it always did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
from google.protobuf.message import DecodeError

from rlep.common.v1 import trajectory_pb2

TRACES_SCHEMA = b"1"
TRACES_KEY = b"rlep.traces_schema"
TRACES_TYPE = pa.list_(pa.binary())


def check_traces_schema(metadata: Mapping[bytes, bytes] | None, schema: pa.Schema) -> str | None:
    """Why the file's traces cannot be read by this version, or None (also for a file without traces)."""
    version = (metadata or {}).get(TRACES_KEY)
    if version is not None and version != TRACES_SCHEMA:
        return (
            f"its tool traces are schema {version.decode(errors='replace')}, this version reads "
            f"{TRACES_SCHEMA.decode()}: import it with a newer rlep"
        )
    if "rlep_traces" in schema.names:
        kind = schema.field("rlep_traces").type
        if not (pa.types.is_list(kind) and (pa.types.is_binary(kind.value_type))):
            return f"`rlep_traces` is {kind}, not {TRACES_TYPE}"
    return None


def traces_to_row(traces: Sequence[trajectory_pb2.Trajectory]) -> list[bytes] | None:
    return [t.SerializeToString() for t in traces] or None


def row_traces(
    row: Mapping[str, Any], question_id: str, max_bytes: int
) -> tuple[list[tuple[trajectory_pb2.Trajectory, int]], int]:
    """The row's traces that can be stored, with their sizes, and how many were left out: over `max_bytes`, not a
    Trajectory message, another question's (a row's traces answer its own question), or no mask (not a trace)."""
    kept, skipped = [], 0
    for blob in row.get("rlep_traces") or []:
        if not blob or len(blob) > max_bytes:
            skipped += 1
            continue
        try:
            trace = trajectory_pb2.Trajectory.FromString(blob)
        except DecodeError:
            skipped += 1
            continue
        if trace.question_id != question_id or not trace.response_mask:
            skipped += 1
            continue
        kept.append((trace, len(blob)))
    return kept, skipped
