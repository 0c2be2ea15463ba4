"""`rlep pool import/export` against a real replay server on loopback (real Redis), with files an unlucky
operator has (issue 46, item 8): an interrupted export, a symlink, a file swapped between check and read,
conflicting question ids, mistyped candidates, dense and over-size rows."""

from __future__ import annotations

import os
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlep.common import pool_parquet
from rlep.services.cli.app import app
from rlep.services.replay.client import ReplayClient
from tests.service_process import rlep_command

pytestmark = pytest.mark.integration


def pool_rows(count: int, candidates: int = 1, first: int = 0) -> list[dict]:
    """Rows of RLEP's released format, one question each, with `candidates` distinct successes."""
    return [
        {
            "data_source": "synthetic",
            "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "ability": "math",
            "reward_model": {
                "ground_truth": str(i + 1),
                "style": "rule",
                "candidates": [f"{i} + 1 = {i + 1}, way {k}: \\boxed{{{i + 1}}}" for k in range(candidates)],
            },
        }
        for i in range(first, first + count)
    ]


def write_rows(rows: list[dict], path) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def address(replay) -> str:
    return f"127.0.0.1:{replay.port}"


@pytest.fixture
def cli(address, auth_token_file):
    """Runs `rlep pool ...` as a user does (its own process) against the test's replay server."""

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [*rlep_command(), "pool", *args, "-a", address, "--auth-token-file", str(auth_token_file)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    return run


def invoke(address: str, auth_token_file, *args: str):
    """`rlep pool ...` in this process (for the tests that interrupt or swap something mid-command)."""
    return CliRunner().invoke(app, ["pool", *args, "-a", address, "--auth-token-file", str(auth_token_file)])


def test_an_interrupted_export_leaves_the_previous_file(
    tmp_path, cli, address, auth_token_file, pool_name, monkeypatch
):
    """Before: the export wrote in place, and one stopped after its first chunk left a valid parquet of 256 rows
    where 300 had been."""
    assert cli("import", write_rows(pool_rows(300), tmp_path / "in.parquet"), "--pool", pool_name).returncode == 0
    out = tmp_path / "out.parquet"
    assert cli("export", pool_name, str(out)).returncode == 0
    assert pq.read_metadata(out).num_rows == 300

    real_export = ReplayClient.export

    def stopped_after_one_chunk(self, pool, *args, **kwargs):
        chunks = real_export(self, pool, *args, **kwargs)
        yield next(chunks)  # 256 questions: the first of two chunks
        raise KeyboardInterrupt  # what Ctrl-C (or a kill) does to a command midway

    monkeypatch.setattr(ReplayClient, "export", stopped_after_one_chunk)
    result = invoke(address, auth_token_file, "export", pool_name, str(out))
    assert result.exit_code != 0
    assert pq.read_metadata(out).num_rows == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "out.parquet"]  # no partial file left


def test_export_refuses_to_write_through_a_symlink(tmp_path, cli, pool_name):
    """Before: export followed the link and overwrote its target."""
    assert cli("import", write_rows(pool_rows(3), tmp_path / "in.parquet"), "--pool", pool_name).returncode == 0
    target = tmp_path / "precious.txt"
    target.write_text("not a pool")
    (tmp_path / "out.parquet").symlink_to(target)
    result = cli("export", pool_name, str(tmp_path / "out.parquet"))
    assert result.returncode == 2 and "symbolic link" in result.stderr, result.stderr
    assert target.read_text() == "not a pool"


def test_import_reads_the_file_it_checked(tmp_path, address, auth_token_file, replay_client, pool_name, monkeypatch):
    """Before: the file was opened again by path after the check, so a file swapped in between was read
    unchecked (a file of unusable rows gave exit 0 and an empty pool)."""
    path = tmp_path / "pool.parquet"
    write_rows(pool_rows(40, candidates=2), path)
    unusable = [{**row, "reward_model": {**row["reward_model"], "candidates": []}} for row in pool_rows(5)]
    write_rows(unusable, tmp_path / "swapped.parquet")
    real_check = pool_parquet.check_pool_file

    def check_then_swap(*args, **kwargs):
        checked = real_check(*args, **kwargs)
        os.replace(tmp_path / "swapped.parquet", path)
        return checked

    monkeypatch.setattr(pool_parquet, "check_pool_file", check_then_swap)
    result = invoke(address, auth_token_file, "import", str(path), "--pool", pool_name)
    assert result.exit_code == 0, result.output
    assert "added 80," in result.output
    stats = replay_client.stats(pool_name)
    assert (stats.questions, stats.trajectories) == (40, 80)


def test_rows_reusing_a_question_id_import_nothing(tmp_path, cli, replay_client, pool_name):
    """Before: rows sharing `extra_info.question_id` merged silently, the wrong answer's candidates stored as
    successes of the other's question."""
    rows = pool_rows(6)
    for i, row in enumerate(rows):
        row["extra_info"] = {"index": i, "question_id": f"q{i}"}
    rows[3]["extra_info"]["question_id"] = "q1"  # another question under q1's id: a different prompt
    rows[5] = {**rows[1], "reward_model": {**rows[1]["reward_model"], "ground_truth": "99"}}  # q1, another answer
    rows.append(dict(rows[2]))  # an exact repeat of q2 is no conflict
    result = cli("import", write_rows(rows, tmp_path / "conflicts.parquet"), "--pool", pool_name)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "2 rows reuse an earlier row's extra_info.question_id" in result.stderr
    assert "first: row 3 has the question_id q1 of row 1 with another prompt" in result.stderr
    assert "Traceback" not in result.stderr and pool_name not in replay_client.list_pools()


def test_candidates_of_the_wrong_type_are_refused_by_the_check(tmp_path, cli, replay_client, pool_name):
    """Before: candidates typed list<int64> passed the check and the import died with `UNKNOWN: Exception
    iterating requests!`."""
    rows = pool_rows(4)
    for i, row in enumerate(rows):
        row["reward_model"]["candidates"] = [i + 1, i + 2]
    result = cli("import", write_rows(rows, tmp_path / "ints.parquet"), "--pool", pool_name)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "`reward_model.candidates` is list<element: int64>, not a list of strings" in result.stderr
    assert "UNKNOWN" not in result.stderr and "Traceback" not in result.stderr
    assert pool_name not in replay_client.list_pools()


def test_dense_and_over_size_rows_do_not_fail_the_import(tmp_path, cli, replay_client, pool_name):
    """Before: 256 rows x 80 candidates made one chunk of 20,480 trajectories (over the 20,000 an add takes), and
    one 300 KB prompt (over max_question_bytes) failed its whole chunk: every re-run of the import failed."""
    rows = pool_rows(256, candidates=80)
    huge_prompt = pool_rows(1, first=1000)[0]
    huge_prompt["prompt"][0]["content"] = "x" * 300_000
    huge_candidate = pool_rows(1, first=2000)[0]
    huge_candidate["reward_model"]["candidates"].append("y" * 1_500_000)
    rows += [huge_prompt, huge_candidate]
    result = cli("import", write_rows(rows, tmp_path / "dense.parquet"), "--pool", pool_name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"added {256 * 80 + 1}, duplicate 0, rejected 0" in result.stdout
    assert "1 rows refused (1 with a question over 262,144 bytes)" in result.stdout
    assert "1 candidates over 1,048,576 bytes skipped" in result.stdout
    assert replay_client.stats(pool_name).questions == 257
