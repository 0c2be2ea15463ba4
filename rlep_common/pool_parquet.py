"""RLEP's released pool format (verl parquet) <-> replay chunks.

Each row: `data_source`, `prompt` (chat list of {role, content}), `ability`,
`reward_model` {ground_truth, style, candidates: list of correct response strings}, `extra_info`
{index, question_id}. Importing turns every candidate into a stored success (verdict CORRECT,
reward 1, policy version 0, run id "import:<file name>") of the row's question; the question id is
`extra_info.question_id` when present (files we exported), else
`rlep.common.dataset.question_id(prompt)` (prompt content only, so a relabelled `data_source` still
matches), the one the learner computes from the training parquet, so imported successes are found
at training time. Exporting writes one row per
question with all its stored successes as candidates, which the reference verl recipe reads as-is.

Per-question history rides along (`pool_file_history`): an `rlep_history` column on the rows, and the history of
questions with no success in the file's key-value metadata; so do tool traces, whole (`pool_file_traces`: an
`rlep_traces` column, never among the candidates); files without them import as before.

Import checks a file once, through the handle it then reads (`check_pool_file`): column types, rows that reuse
a kept question id with another prompt or answer (the whole file refused), over-size rows and candidates (left
out one by one, counted). Chunks are cut by trajectories and bytes. Export replaces its target atomically.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from rlep.common.atomic_file import atomic_write
from rlep.common.dataset import QuestionIdConflicts, verl_prompt, verl_question_id
from rlep.common.pool_file_history import (
    HISTORY_ONLY_KEY,
    HISTORY_SCHEMA,
    HISTORY_TYPE,
    SCHEMA_KEY,
    HistoryFileError,
    check_history_schema,
    history_from_row,
    history_only_bytes,
    history_to_row,
    read_history_only,
)
from rlep.common.pool_file_traces import (
    TRACES_KEY,
    TRACES_SCHEMA,
    TRACES_TYPE,
    check_traces_schema,
    row_traces,
    traces_to_row,
)
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2

ROW_BATCH = 256  # rows read from the file at a time
CANDIDATE_VERSION = 0  # imported successes predate any policy version of this system

# An import chunk is one atomic add on the server: it must stay under the replay service's
# `max_trajectories_per_add` (20,000) and its message limit (`server.max_request_bytes`, 64 MiB) whatever the
# rows hold, so chunks are cut by trajectories and bytes, not rows (80 candidates x 256 rows passed 20,000).
CHUNK_TRAJECTORIES = 4096
CHUNK_BYTES = 8 * 1024 * 1024
# What a trajectory carries beside its text (question id, run id, tags), over-estimated.
TRAJECTORY_OVERHEAD = 1024


@dataclass(frozen=True)
class RowLimits:
    """What one row may weigh: the replay service's defaults (`max_question_bytes`, `max_trajectory_bytes`;
    a test keeps them equal). A row whose question is larger is refused alone, a candidate larger is skipped
    alone, so one over-size row no longer fails a whole import."""

    question_bytes: int = 256 * 1024
    trajectory_bytes: int = 1 << 20


REQUIRED = {"prompt": None, "reward_model": ("ground_truth", "candidates")}
EXPECTED = "a pool file has `prompt` and `reward_model.{ground_truth, candidates}`, as `rlep pool export` writes"


class PoolFileError(ValueError):
    """A file that is not a pool file: nothing of it is imported."""


@dataclass(frozen=True)
class PoolFileCheck:
    rows: int
    refused: Counter = field(default_factory=Counter)
    """Rows that cannot be imported, by reason (empty prompt, no ground truth, no candidates, over size)."""
    skipped_candidates: int = 0
    """Candidates over `RowLimits.trajectory_bytes`, left out one by one."""
    path: Path = Path()
    skipped_traces: int = 0
    """Tool traces that cannot be stored (`pool_file_traces.row_traces`), left out one by one."""
    parquet: pq.ParquetFile | None = field(default=None, compare=False, repr=False)
    """The file as checked, still open: the import reads these bytes, not the path again (a file swapped
    between the check and the read would otherwise be imported unchecked)."""
    history_only: list = field(default_factory=list, compare=False, repr=False)
    """(Question or None, QuestionHistory) of the questions with history and no success (`pool_file_history`)."""

    @property
    def importable(self) -> int:
        return self.rows - sum(self.refused.values())

    def describe_refused(self) -> str:
        return ", ".join(f"{count} with {reason}" for reason, count in sorted(self.refused.items()))


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _type_problem(schema: pa.Schema) -> str | None:
    """Why the columns' types cannot be imported (a list<int64> of candidates once failed mid-stream), or None."""
    prompt = schema.field("prompt").type
    message = prompt.value_type if _is_list(prompt) else None
    if not _is_text(prompt) and not (
        message is not None
        and pa.types.is_struct(message)
        and all(message.get_field_index(f) >= 0 and _is_text(message.field(f).type) for f in ("role", "content"))
    ):
        return f"`prompt` is {prompt}, not a string or a list of {{role: string, content: string}}"
    reward_model = schema.field("reward_model").type
    gold = reward_model.field("ground_truth").type
    if not (_is_text(gold) or pa.types.is_integer(gold) or pa.types.is_floating(gold)):
        return f"`reward_model.ground_truth` is {gold}, not a string or a number"
    candidates = reward_model.field("candidates").type
    if not (_is_list(candidates) and _is_text(candidates.value_type)):
        return f"`reward_model.candidates` is {candidates}, not a list of strings"
    return None


def row_question(row: Mapping[str, Any]) -> replay_pb2.Question:
    """The question a pool file's row stores (`row_problem` first)."""
    prompt = verl_prompt(row)
    extra = row.get("extra_info") or {}
    return replay_pb2.Question(
        question_id=verl_question_id(row, prompt),
        ground_truth=str((row.get("reward_model") or {}).get("ground_truth", "")),
        data_source=row.get("data_source") or "",
        index=int(extra["index"]) if extra.get("index") is not None else -1,
        prompt=[replay_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt],
    )


def row_problem(row: Mapping[str, Any], limits: RowLimits = RowLimits()) -> str | None:
    """Why a pool file's row cannot be imported, or None."""
    prompt = verl_prompt(row)
    if not prompt or not all(isinstance(m, dict) and m.get("role") and m.get("content") for m in prompt):
        return "an empty prompt"
    reward_model = row.get("reward_model") or {}
    if not str(reward_model.get("ground_truth") or "").strip():
        return "no ground truth"
    if not any(reward_model.get("candidates") or []) and not row.get("rlep_traces"):
        return "no candidates"
    if not _question_fits(row, prompt, limits):
        return f"a question over {limits.question_bytes:,} bytes"
    return None


def _question_fits(row: Mapping[str, Any], prompt: list[dict[str, str]], limits: RowLimits) -> bool:
    # UTF-8 takes at most 4 bytes a character: almost every row is far under the bound, and skips building
    # its message (which doubled the time of a check).
    texts = [str((row.get("reward_model") or {}).get("ground_truth", "")), row.get("data_source") or ""]
    chars = sum(len(m["content"]) + len(m["role"]) for m in prompt) + sum(map(len, texts))
    return chars * 4 + 1024 <= limits.question_bytes or row_question(row).ByteSize() <= limits.question_bytes


def _row_candidates(row: Mapping[str, Any], limits: RowLimits) -> tuple[list[tuple[str, int]], int]:
    """A row's candidates within `limits.trajectory_bytes` with their sizes in bytes, and how many were left out
    for their size."""
    kept, skipped = [], 0
    for candidate in (row.get("reward_model") or {}).get("candidates") or []:
        if not candidate:
            continue
        size = len(candidate.encode("utf-8"))
        # The stored trajectory carries ids and tags beside the text: keep a margin below the server's bound.
        if size > limits.trajectory_bytes - TRAJECTORY_OVERHEAD:
            skipped += 1
        else:
            kept.append((candidate, size))
    return kept, skipped


def check_pool_file(path: Path, limits: RowLimits = RowLimits()) -> PoolFileCheck:
    """Checks `path` against the pool schema and every row, before anything is sent: PoolFileError naming what is
    missing or mistyped when the columns are wrong, or the rows that reuse an `extra_info.question_id` with
    another prompt or answer; else the rows, the ones to refuse, and the file still open for `read_pool_rows`."""
    try:
        parquet = pq.ParquetFile(pa.OSFile(str(path)))  # opened once: the import reads this handle
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError) as err:
        raise PoolFileError(f"{path} is not a parquet file ({err}); {EXPECTED}") from err
    for column, fields in REQUIRED.items():
        if column not in schema.names:
            raise PoolFileError(f"{path} has no `{column}` column (it has {', '.join(schema.names)}); {EXPECTED}")
        kind = schema.field(column).type
        if fields and not (pa.types.is_struct(kind) and all(kind.get_field_index(f) >= 0 for f in fields)):
            have = ", ".join(kind.field(i).name for i in range(kind.num_fields)) if pa.types.is_struct(kind) else kind
            raise PoolFileError(
                f"{path}: `{column}` has {have}, not {', '.join(fields)}; {EXPECTED} (a training parquet has no "
                "candidates; import it with `rlep train`, or collect a pool with `rlep collect`)"
            )
    metadata = parquet.metadata.metadata
    if problem := (
        _type_problem(schema) or check_history_schema(metadata, schema) or check_traces_schema(metadata, schema)
    ):
        raise PoolFileError(f"{path}: {problem}; {EXPECTED}")
    try:
        history_only = read_history_only(parquet.metadata.metadata)
    except HistoryFileError as err:
        raise PoolFileError(f"{path}: {err}; nothing imported") from err
    refused: Counter = Counter()
    skipped = skipped_traces = 0
    conflicts = QuestionIdConflicts()
    index = 0
    for batch in parquet.iter_batches(batch_size=ROW_BATCH):
        for row in batch.to_pylist():
            if problem := row_problem(row, limits):
                refused[problem] += 1
            else:
                conflicts.add(index, row, verl_prompt(row))
                skipped += _row_candidates(row, limits)[1]
                skipped_traces += row_traces(row, verl_question_id(row, verl_prompt(row)), _trace_bytes(limits))[1]
            index += 1
    if conflicts.count:
        raise PoolFileError(f"{path}: {conflicts.describe()}; nothing imported")
    return PoolFileCheck(parquet.metadata.num_rows, refused, skipped, Path(path), skipped_traces, parquet, history_only)


def read_pool_rows(
    source: Path | PoolFileCheck, pool: str, limits: RowLimits = RowLimits()
) -> Iterator[replay_pb2.PoolChunk]:
    """Yields import chunks of at most `CHUNK_TRAJECTORIES` trajectories and about `CHUNK_BYTES` bytes; rows
    `row_problem` refuses and candidates over size are left out. `source`: a checked file (`check_pool_file`,
    read through the handle it checked) or a path. A row with more candidates than a chunk holds is split
    across chunks, its question sent with each part (adds are idempotent)."""
    if isinstance(source, PoolFileCheck):
        parquet, path, history_only = source.parquet, source.path, source.history_only
    else:
        parquet, path = pq.ParquetFile(source), Path(source)
        history_only = read_history_only(parquet.metadata.metadata)
    run_id = f"import:{path.name}"
    chunk, size = replay_pb2.PoolChunk(pool=pool), 0
    for batch in parquet.iter_batches(batch_size=ROW_BATCH):
        for row in batch.to_pylist():
            if row_problem(row, limits):
                continue
            question, in_chunk = row_question(row), False
            successes = [
                (
                    trajectory_pb2.Trajectory(
                        question_id=question.question_id,
                        response_text=candidate,
                        reward=1.0,
                        verdict=trajectory_pb2.CORRECT,
                        source=trajectory_pb2.REPLAY,
                        policy_version=CANDIDATE_VERSION,
                        run_id=run_id,
                    ),
                    candidate_bytes,
                )  # fmt: skip
                for candidate, candidate_bytes in _row_candidates(row, limits)[0]
            ]
            traces = row_traces(row, question.question_id, _trace_bytes(limits))[0]
            for trace, _ in traces:  # another run's traces from here on: any age replays (TraceRules)
                trace.source, trace.run_id = trajectory_pb2.REPLAY, run_id
            for trajectory, trajectory_bytes in successes + traces:
                cost = trajectory_bytes + TRAJECTORY_OVERHEAD
                if chunk.trajectories and (len(chunk.trajectories) >= CHUNK_TRAJECTORIES or size + cost > CHUNK_BYTES):
                    yield chunk
                    chunk, size, in_chunk = replay_pb2.PoolChunk(pool=pool), 0, False
                if not in_chunk:  # the question goes with each chunk holding some of its candidates
                    chunk.questions.append(question)
                    size += question.ByteSize()
                    in_chunk = True
                    if row.get("rlep_history"):  # stored once per question whatever chunk repeats it
                        chunk.histories.append(history_from_row(question.question_id, row["rlep_history"]))
                chunk.trajectories.append(trajectory)
                size += cost
    if chunk.trajectories:
        yield chunk
    yield from _history_only_chunks(pool, history_only)


def _trace_bytes(limits: RowLimits) -> int:
    # A trace is stored as it is in the file, its run id and source aside: keep the margin candidates keep.
    return limits.trajectory_bytes - TRAJECTORY_OVERHEAD


def _history_only_chunks(pool: str, history_only: list) -> Iterator[replay_pb2.PoolChunk]:
    chunk, size = replay_pb2.PoolChunk(pool=pool), 0
    for question, history in history_only:
        if chunk.histories and (len(chunk.histories) >= CHUNK_TRAJECTORIES or size > CHUNK_BYTES):
            yield chunk
            chunk, size = replay_pb2.PoolChunk(pool=pool), 0
        if question is not None:
            chunk.questions.append(question)
            size += question.ByteSize()
        chunk.histories.append(history)
        size += history.ByteSize()
    if chunk.histories:
        yield chunk


POOL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        (
            "reward_model",
            pa.struct([("ground_truth", pa.string()), ("style", pa.string()), ("candidates", pa.list_(pa.string()))]),
        ),
        ("extra_info", pa.struct([("index", pa.int64()), ("question_id", pa.string())])),
        ("rlep_history", HISTORY_TYPE),
        ("rlep_traces", TRACES_TYPE),
    ],
    metadata={SCHEMA_KEY: HISTORY_SCHEMA, TRACES_KEY: TRACES_SCHEMA},
)


def write_pool_rows(chunks: Iterable[replay_pb2.PoolChunk], path: Path) -> int:
    """Writes exported chunks as verl parquet rows; returns the number of rows.

    The rows go to a temporary file beside `path`, which replaces `path` only once every chunk is written and
    synced: an export stopped midway (killed, the stream broken) leaves `path` as it was, never a valid-looking
    file of part of the pool. A symlink at `path` is refused (PoolFileError), not followed.
    """
    path = Path(path)
    if path.is_symlink():
        raise PoolFileError(f"{path} is a symbolic link; export writes a file of its own: name another path")
    try:
        with atomic_write(path, _file_mode(path)) as file:  # the mode an ordinary new file (or the replaced one) has
            rows_written = _write_rows(chunks, file)
    except HistoryFileError as err:
        raise PoolFileError(f"{path}: {err}; nothing written") from err
    return rows_written


def _file_mode(path: Path) -> int:
    if path.exists():
        return stat.S_IMODE(path.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_rows(chunks: Iterable[replay_pb2.PoolChunk], file: BinaryIO) -> int:
    rows_written = 0
    history_only: list[tuple[str, bytes | None, replay_pb2.QuestionHistory]] = []
    with pq.ParquetWriter(file, POOL_SCHEMA) as writer:
        for chunk in chunks:
            candidates: dict[str, list[str]] = {}
            traces: dict[str, list[trajectory_pb2.Trajectory]] = {}
            for traj in chunk.trajectories:
                if traj.response_mask:  # a tool trace: whole, in its own column, never a candidate
                    traces.setdefault(traj.question_id, []).append(traj)
                else:
                    candidates.setdefault(traj.question_id, []).append(traj.response_text)
            histories = {h.question_id: h for h in chunk.histories}
            # A question with history and no success has no row (a row needs successes, and verl a prompt).
            alone = {q for q in histories if q not in candidates and q not in traces}
            metas = {q.question_id: q.SerializeToString() for q in chunk.questions if q.question_id in alone}
            history_only += [(q, metas.get(q), histories[q]) for q in histories if q in alone]
            rows = [
                {
                    "data_source": q.data_source,
                    "prompt": [{"content": m.content, "role": m.role} for m in q.prompt],
                    "ability": "math",
                    "reward_model": {
                        "ground_truth": q.ground_truth,
                        "style": "rule",
                        "candidates": candidates.get(q.question_id, []),
                    },
                    "extra_info": {"index": q.index, "question_id": q.question_id},
                    "rlep_history": history_to_row(histories[q.question_id]) if q.question_id in histories else None,
                    "rlep_traces": traces_to_row(traces.get(q.question_id, [])),
                }
                for q in chunk.questions
                if q.question_id not in alone
            ]
            if rows:
                writer.write_table(pa.Table.from_pylist(rows, schema=POOL_SCHEMA))
                rows_written += len(rows)
        if history_only:
            writer.add_key_value_metadata({HISTORY_ONLY_KEY: history_only_bytes(history_only)})
    return rows_written
