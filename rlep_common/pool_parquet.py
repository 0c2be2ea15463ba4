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

from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlep.common.dataset import verl_prompt, verl_question_id
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2

ROW_BATCH = 256
CANDIDATE_VERSION = 0  # imported successes predate any policy version of this system


def read_pool_rows(path: Path, pool: str, batch_rows: int = ROW_BATCH) -> Iterator[replay_pb2.PoolChunk]:
    """Yields import chunks of `batch_rows` rows; rows without candidates only register their question."""
    parquet = pq.ParquetFile(path)
    run_id = f"import:{Path(path).name}"
    for batch in parquet.iter_batches(batch_size=batch_rows):
        chunk = replay_pb2.PoolChunk(pool=pool)
        for row in batch.to_pylist():
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
