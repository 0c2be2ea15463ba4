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


def _trace_chunk(qid: str = "q") -> replay_pb2.PoolChunk:
    chunk = replay_pb2.PoolChunk(pool="p")
    chunk.questions.add(question_id=qid, ground_truth="42", prompt=[replay_pb2.ChatMessage(role="user", content="6*7")])
    chunk.trajectories.add(question_id=qid, response_text="\\boxed{42}", verdict=1)  # a single-turn answer
    trace = chunk.trajectories.add(
        question_id=qid, response_text="<code>print(6*7)</code><output>\n\\boxed{42}\n</output>\\boxed{42}",
        verdict=1, response_token_ids=[5, 6, 7, 8], response_mask=[1, 0, 0, 1], tokenizer_fingerprint="t" * 16,
        chat_template_hash="c" * 32, tool_env_hash="e" * 32, policy_version=7, run_id="run-a",
    )  # fmt: skip
    trace.tool_calls.add(code="print(6*7)", status="ok", exit_code=0, stdout="\\boxed{42}\n")
    return chunk


def test_a_tool_trace_round_trips_whole_and_is_never_a_candidate(tmp_path):
    """A verl reader (or an older rlep) takes candidates for answers the policy wrote: a trace's text holds the tool's
    output, so it travels only in `rlep_traces`, whole, and comes back as a trace."""
    path = tmp_path / "traces.parquet"
    assert write_pool_rows([_trace_chunk()], path) == 1
    [row] = pq.read_table(path).to_pylist()
    assert row["reward_model"]["candidates"] == ["\\boxed{42}"] and len(row["rlep_traces"]) == 1
    [chunk] = list(read_pool_rows(path, "p"))
    single, trace = chunk.trajectories
    assert not single.response_mask and single.response_text == "\\boxed{42}"
    stored = _trace_chunk().trajectories[1]
    assert list(trace.response_mask) == [1, 0, 0, 1] and trace.tool_calls == stored.tool_calls
    assert (trace.response_token_ids, trace.tool_env_hash, trace.policy_version) == (
        stored.response_token_ids, stored.tool_env_hash, 7
    )  # fmt: skip
    assert trace.run_id == "import:traces.parquet" and trace.source == 2  # another run's trace from now on


def test_a_row_of_traces_only_imports_and_bad_traces_are_left_out_one_by_one(tmp_path):
    from rlep.common.pool_parquet import check_pool_file

    chunk = _trace_chunk()
    del chunk.trajectories[0]  # the question's only success is a trace: the row has no candidate
    path = tmp_path / "only.parquet"
    write_pool_rows([chunk], path)
    table = pq.read_table(path)
    good = table.column("rlep_traces")[0].as_py()[0]
    other = chunk.trajectories[0].__deepcopy__()
    other.question_id = "another question"
    unmasked = chunk.trajectories[0].__deepcopy__()
    del unmasked.response_mask[:]
    bad = [b"\xff not a message", other.SerializeToString(), unmasked.SerializeToString(), b"x" * (2 << 20)]
    rows = table.to_pylist()
    rows[0]["rlep_traces"] = [good, *bad]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    check = check_pool_file(path)
    assert check.importable == 1 and (check.skipped_candidates, check.skipped_traces) == (0, 4)
    [imported] = list(read_pool_rows(check, "p"))
    assert [list(t.response_mask) for t in imported.trajectories] == [[1, 0, 0, 1]]


def test_a_file_of_a_later_trace_schema_is_refused(tmp_path):
    from rlep.common.pool_parquet import PoolFileError, check_pool_file

    path = tmp_path / "later.parquet"
    write_pool_rows([_trace_chunk()], path)
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"rlep.traces_schema": b"2"}), path)
    with pytest.raises(PoolFileError, match="tool traces are schema 2, this version reads 1"):
        check_pool_file(path)
