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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlep.common.dataset import verl_prompt, verl_question_id
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2

ROW_BATCH = 256
CANDIDATE_VERSION = 0  # imported successes predate any policy version of this system


REQUIRED = {"prompt": None, "reward_model": ("ground_truth", "candidates")}
EXPECTED = "a pool file has `prompt` and `reward_model.{ground_truth, candidates}`, as `rlep pool export` writes"


class PoolFileError(ValueError):
    """A file that is not a pool file: nothing of it is imported."""


@dataclass(frozen=True)
class PoolFileCheck:
    rows: int
    refused: Counter = field(default_factory=Counter)
    """Rows that cannot be imported, by reason (empty prompt, no ground truth, no candidates)."""

    @property
    def importable(self) -> int:
        return self.rows - sum(self.refused.values())

    def describe_refused(self) -> str:
        return ", ".join(f"{count} with {reason}" for reason, count in sorted(self.refused.items()))


def row_problem(row: Mapping[str, Any]) -> str | None:
    """Why a pool file's row cannot be imported, or None."""
    prompt = verl_prompt(row)
    if not prompt or not all(isinstance(m, dict) and m.get("role") and m.get("content") for m in prompt):
        return "an empty prompt"
    reward_model = row.get("reward_model") or {}
    if not str(reward_model.get("ground_truth") or "").strip():
        return "no ground truth"
    if not any(reward_model.get("candidates") or []):
        return "no candidates"
    return None


def check_pool_file(path: Path) -> PoolFileCheck:
    """Checks `path` against the pool schema and every row, before anything is sent: PoolFileError naming what is
    missing when the columns are wrong; else the rows and the ones to refuse."""
    try:
        schema = pq.read_schema(path)
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
    parquet = pq.ParquetFile(path)
    refused: Counter = Counter()
    for batch in parquet.iter_batches(batch_size=ROW_BATCH, columns=list(REQUIRED)):
        refused.update(problem for row in batch.to_pylist() if (problem := row_problem(row)))
    return PoolFileCheck(parquet.metadata.num_rows, refused)


def read_pool_rows(path: Path, pool: str, batch_rows: int = ROW_BATCH) -> Iterator[replay_pb2.PoolChunk]:
    """Yields import chunks of `batch_rows` rows; rows `row_problem` refuses are left out (`check_pool_file` first)."""
    parquet = pq.ParquetFile(path)
    run_id = f"import:{Path(path).name}"
    for batch in parquet.iter_batches(batch_size=batch_rows):
        chunk = replay_pb2.PoolChunk(pool=pool)
        for row in batch.to_pylist():
            if row_problem(row):
                continue
            prompt = verl_prompt(row)
            source = row.get("data_source") or ""
            reward_model = row.get("reward_model") or {}
            extra = row.get("extra_info") or {}
            qid = verl_question_id(row, prompt)
            chunk.questions.add(
                question_id=qid,
                ground_truth=str(reward_model.get("ground_truth", "")),
                data_source=source,
                index=int(extra["index"]) if extra.get("index") is not None else -1,
                prompt=[replay_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt],
            )
            for candidate in reward_model.get("candidates") or []:
                if candidate:
                    chunk.trajectories.add(
                        question_id=qid,
                        response_text=candidate,
                        reward=1.0,
                        verdict=trajectory_pb2.CORRECT,
                        source=trajectory_pb2.REPLAY,
                        policy_version=CANDIDATE_VERSION,
                        run_id=run_id,
                    )
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
    ]
)


def write_pool_rows(chunks: Iterable[replay_pb2.PoolChunk], path: Path) -> int:
    """Writes exported chunks as verl parquet rows; returns the number of rows."""
    rows_written = 0
    with pq.ParquetWriter(path, POOL_SCHEMA) as writer:
        for chunk in chunks:
            candidates: dict[str, list[str]] = {}
            for traj in chunk.trajectories:
                candidates.setdefault(traj.question_id, []).append(traj.response_text)
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
                }
                for q in chunk.questions
            ]
            if rows:
                writer.write_table(pa.Table.from_pylist(rows, schema=POOL_SCHEMA))
                rows_written += len(rows)
    return rows_written
