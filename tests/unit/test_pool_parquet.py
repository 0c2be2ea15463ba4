"""Pool files' pure logic: chunk bounds, row size limits, question id conflicts (issue 46, item 8)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlep.common.config import ServerConfig
from rlep.common.dataset import DatasetError, read_verl_parquet
from rlep.common.pool_parquet import CHUNK_BYTES, CHUNK_TRAJECTORIES, RowLimits, read_pool_rows, write_pool_rows
from rlep.replay.v1 import replay_pb2
from rlep.services.replay.config import ReplayConfig
from tests.conftest import TEST_DATA


def test_row_limits_and_chunks_fit_the_replay_services_defaults():
    replay = ReplayConfig.model_fields
    assert RowLimits() == RowLimits(replay["max_question_bytes"].default, replay["max_trajectory_bytes"].default)
    assert replay["max_trajectories_per_add"].default > CHUNK_TRAJECTORIES
    assert ServerConfig.model_fields["max_request_bytes"].default // 2 > CHUNK_BYTES


def test_a_row_with_more_candidates_than_a_chunk_holds_is_split(tmp_path):
    """A chunk is one add: more trajectories than the server takes in one would fail it on every re-run."""
    candidates = [f"way {k}: \\boxed{{2}}" for k in range(2 * CHUNK_TRAJECTORIES + 5)]
    row = {
        "prompt": [{"role": "user", "content": "1+1?"}],
        "reward_model": {"ground_truth": "2", "candidates": candidates},
    }
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "wide.parquet")
    chunks = list(read_pool_rows(tmp_path / "wide.parquet", "p"))
    assert [len(c.trajectories) for c in chunks] == [CHUNK_TRAJECTORIES, CHUNK_TRAJECTORIES, 5]
    assert all(len(c.questions) == 1 for c in chunks)  # each part carries its question (adds are idempotent)
    assert [t.response_text for c in chunks for t in c.trajectories] == candidates


def test_chunks_are_cut_by_bytes(tmp_path):
    big = "z" * 600_000  # under the 1 MiB a trajectory may weigh; 14 of them pass 8 MiB
    rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": "1", "candidates": [big]}}
        for i in range(30)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "heavy.parquet")
    chunks = list(read_pool_rows(tmp_path / "heavy.parquet", "p"))
    assert len(chunks) > 1 and all(c.ByteSize() <= CHUNK_BYTES for c in chunks)
    assert sum(len(c.trajectories) for c in chunks) == 30


def _row(qid: str | None, content: str, gold: str) -> dict:
    extra = {"index": 0, "question_id": qid}
    return {
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"ground_truth": gold},
        "extra_info": extra,
    }


def test_training_files_reusing_a_question_id_are_refused(tmp_path):
    rows = [_row("a", "1+1?", "2"), _row("b", "2+2?", "4"), _row("a", "1+1?", "3"), _row("a", "1+1?", "2")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(
        DatasetError,
        match=r"1 rows reuse .*first: row 2 has the question_id a of row 0 with another "
        r"ground truth",
    ):
        read_verl_parquet(tmp_path / "t.parquet")


def test_a_repeated_prompt_without_a_kept_id_is_no_conflict():
    """DAPO-Math-17k repeats a prompt with two gold answers (rows 35 and 179 of the test slice): both load."""
    questions = read_verl_parquet(TEST_DATA / "dapo_math_17k.parquet")
    assert len(questions) == 200 and len({q.question_id for q in questions}) == 199


def test_export_replaces_the_file_whole_and_keeps_its_mode(tmp_path):
    out = tmp_path / "out.parquet"
    out.write_text("old")
    out.chmod(0o640)
    chunk = replay_pb2.PoolChunk(pool="p")
    chunk.questions.add(question_id="q", ground_truth="2", prompt=[replay_pb2.ChatMessage(role="user", content="x")])
    chunk.trajectories.add(question_id="q", response_text="\\boxed{2}")

    def failing():
        yield chunk
        raise ConnectionError("stream broken")

    with pytest.raises(ConnectionError):
        write_pool_rows(failing(), out)
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.parquet"]
    assert write_pool_rows([chunk], out) == 1
    assert pq.read_table(out).num_rows == 1 and (out.stat().st_mode & 0o777) == 0o640


def test_a_kept_id_on_copies_of_one_prompt_is_no_conflict(tmp_path):
    """Copies that differ in whitespace or Unicode form are one question (`question_id` normalises them too)."""
    rows = [_row("a", "Café  costs\n3?", "3"), _row("a", "Cafe\u0301 costs 3? ", "3"), _row("a", "Cafe costs 3?", "3")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(
        DatasetError, match=r"^.*: 1 rows reuse .*first: row 2 has the question_id a of row 0 with another prompt"
    ):
        read_verl_parquet(tmp_path / "t.parquet")
