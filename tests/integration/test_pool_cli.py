"""`rlep serve replay` on the embedded default (its own redis-server) driven by `rlep pool ...`."""

from __future__ import annotations

import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from rlep.common.dataset import question_id
from rlep.common.grpc_channel import make_channel
from rlep.services.replay.client import ReplayClient
from tests.conftest import TEST_DATA
from tests.service_process import rlep_command, start_service

pytestmark = pytest.mark.integration


def make_pool_parquet(path, rows: int = 40) -> list[dict]:
    """A file in RLEP's released format: real DAPO-17k rows plus candidate solutions."""
    table = pq.read_table(TEST_DATA / "dapo_math_17k.parquet").slice(0, rows).to_pylist()
    for i, row in enumerate(table):
        gold = row["reward_model"]["ground_truth"]
        row["reward_model"]["candidates"] = [
            f"Attempt {k}: ... so the answer is \\boxed{{{gold}}}" for k in range(i % 3 + 1)
        ]
    pq.write_table(pa.Table.from_pylist(table), path)
    return table


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*rlep_command(), *args], capture_output=True, text=True, check=check, timeout=120)


def test_embedded_replay_with_pool_cli_round_trip(tmp_path):
    rows = make_pool_parquet(tmp_path / "pool.parquet")
    replay = start_service("replay", tmp_path / "replay.out", sets=[f"local_redis_dir={tmp_path / 'redis'}"])
    address = replay.address
    try:
        candidates = sum(len(r["reward_model"]["candidates"]) for r in rows)
        imported = run("pool", "import", str(tmp_path / "pool.parquet"), "--pool", "rlep-ref", "-a", address)
        assert f"added {candidates}, duplicate 0, rejected 0" in imported.stdout
        stats = run("pool", "stats", "rlep-ref", "-a", address).stdout
        assert "│ questions" in stats and f"│ {candidates} " in stats
        # imported text has no token ids: its lengths are words, and the table says so (issue 32, item 10)
        assert "response length (tokens, or words without token ids)" in " ".join(stats.split())
        assert "rlep-ref" in run("pool", "list", "-a", address).stdout
        run("pool", "export", "rlep-ref", str(tmp_path / "out.parquet"), "-a", address)
        exported = {r["extra_info"]["question_id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
        for row in rows:
            qid = question_id(row["prompt"])
            out = exported[qid]
            assert sorted(out["reward_model"]["candidates"]) == sorted(row["reward_model"]["candidates"])
            assert out["reward_model"]["ground_truth"] == row["reward_model"]["ground_truth"]
            assert out["prompt"] == row["prompt"] and out["data_source"] == "DAPO-17k"
        again = run("pool", "import", str(tmp_path / "out.parquet"), "--pool", "rlep-copy", "-a", address)
        assert f"added {candidates}," in again.stdout
        with ReplayClient(address) as client:
            ref, copy = client.stats("rlep-ref"), client.stats("rlep-copy")
        # payload bytes differ by design: each import records its file name as the run id
        for field in ("questions", "trajectories", "successes_per_question", "response_token_histogram"):
            assert getattr(ref, field) == getattr(copy, field), field
        missing = run("pool", "stats", "nope", "-a", address, check=False)
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr

        database = ProtoReflectionDescriptorDatabase(make_channel(address))  # what grpcurl does
        assert "rlep.replay.v1.ReplayBuffer" in database.get_services()
        service = database.FindFileContainingSymbol("rlep.replay.v1.ReplayBuffer").service[0]
        assert {"AddTrajectories", "Sample", "GetPoolStats", "ExportPool", "ImportPool"} <= {
            m.name for m in service.method
        }
        assert (
            run("pool", "drop", "rlep-copy", "--yes", "-a", address).stdout
            == f"dropped rlep-copy: {candidates} trajectories\n"
        )
    finally:
        output = replay.stop(timeout_s=30)
    assert replay.returncode == 0, output
    assert (tmp_path / "redis" / "appendonlydir").exists() or list((tmp_path / "redis").glob("*.aof"))
    # The banner names the embedded Redis without its password (kept in a 0600 file beside its data).
    password = (tmp_path / "redis" / "redis.password").read_text().strip()
    assert "replay listening" in output and "redis=redis://:***@127.0.0.1:" in output
    assert password not in output


def _wrong_files(tmp_path) -> dict[str, tuple[str, str]]:
    """Pool files in a wrong schema (issue 31): file -> (what the error must name, why)."""
    rows = make_pool_parquet(tmp_path / "good.parquet")
    renamed = [{("problem" if k == "prompt" else k): v for k, v in row.items()} for row in rows]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "problem-column.parquet")
    top_level = [
        {**row, "candidates": row["reward_model"]["candidates"], "reward_model": {"ground_truth": "1", "style": "r"}}
        for row in rows
    ]
    pq.write_table(pa.Table.from_pylist(top_level), tmp_path / "top-level-candidates.parquet")
    plain = pq.read_table(TEST_DATA / "dapo_math_17k.parquet").slice(0, 10)
    pq.write_table(plain, tmp_path / "training.parquet")
    empty = [{**row, "reward_model": {**row["reward_model"], "candidates": []}} for row in rows[:5]]
    empty += [{**row, "prompt": []} for row in rows[5:8]]
    pq.write_table(pa.Table.from_pylist(empty), tmp_path / "no-usable-row.parquet")
    return {
        "problem-column.parquet": ("no `prompt` column", "the prompt column is named `problem`"),
        "top-level-candidates.parquet": ("`reward_model` has ground_truth, style", "candidates outside reward_model"),
        "training.parquet": ("not ground_truth, candidates", "a training parquet"),
        "no-usable-row.parquet": ("all 8 rows refused (3 with an empty prompt, 5 with no candidates)", "no usable row"),
    }


def test_a_wrong_pool_file_imports_nothing_and_creates_no_pool(tmp_path):
    """Before the check, a renamed prompt column merged 40 questions under one id and evicted real answers, and a
    training parquet left an empty pool behind, both with exit 0."""
    cases = _wrong_files(tmp_path)
    replay = start_service("replay", tmp_path / "replay.out", sets=[f"local_redis_dir={tmp_path / 'redis'}"])
    address = replay.address
    try:
        for name, (named, why) in cases.items():
            result = run("pool", "import", str(tmp_path / name), "--pool", "target", "-a", address, check=False)
            assert result.returncode != 0, f"{why}: {result.stdout}"
            assert named in result.stderr and "Traceback" not in result.stderr, (why, result.stderr)
        with ReplayClient(address) as client:
            assert "target" not in client.list_pools()

        mixed = make_pool_parquet(tmp_path / "mixed.parquet")
        mixed[0]["reward_model"]["candidates"], mixed[1]["prompt"] = [], []
        pq.write_table(pa.Table.from_pylist(mixed), tmp_path / "mixed.parquet")
        result = run("pool", "import", str(tmp_path / "mixed.parquet"), "--pool", "target", "-a", address)
        candidates = sum(len(r["reward_model"]["candidates"]) for r in mixed[2:])
        assert f"added {candidates}," in result.stdout
        assert "2 rows refused (1 with an empty prompt, 1 with no candidates)" in result.stdout
        with ReplayClient(address) as client:
            assert client.stats("target").questions == len(mixed) - 2
    finally:
        replay.stop(timeout_s=30)
