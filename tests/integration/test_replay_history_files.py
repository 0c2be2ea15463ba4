"""Per-question history (issue 48, part 1) in pool files and across crashes: export -> import keeps every record,
files without history still import, a later or damaged history is refused, and kill -9 of the replay server and of
its Redis loses no acknowledged report."""

from __future__ import annotations

import threading

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlep.common.dataset import read_verl_parquet
from rlep.common.pool_file_history import HISTORY_ONLY_KEY, SCHEMA_KEY, read_history_only
from rlep.common.pool_parquet import POOL_SCHEMA, PoolFileError, check_pool_file, read_pool_rows, write_pool_rows
from rlep.common.redis_server import start_local_redis
from rlep.common.types import Trajectory, Verdict
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.services.replay.client import ReplayClient
from tests.integration.test_replay_history import every_question, outcome
from tests.service_process import start_service

pytestmark = pytest.mark.integration

HISTORY_FIELDS = ("questions_with_history", "pass_rate_histogram", "rescues", "mastered_questions")


def question(qid: str) -> replay_pb2.Question:
    prompt = [replay_pb2.ChatMessage(role="user", content=f"What is {qid}?")]
    return replay_pb2.Question(question_id=qid, prompt=prompt, ground_truth="4", data_source="test", index=1)


def fill(client, pool: str) -> None:
    """s0..s4 hold successes (and metadata); h0..h4 only history, h0 with metadata sent by a report."""
    solved = [f"s{i}" for i in range(5)]
    client.add(
        pool,
        [Trajectory(q, f"so {q} is \\boxed{{4}}", 1.0, verdict=Verdict.CORRECT) for q in solved],
        [question(q) for q in solved],
    )
    for step in range(6):
        outcomes = [outcome(f"s{i}", 4, (i + step) % 5, replayed=2) for i in range(5)]
        outcomes += [outcome(f"h{i}", 8, 0, replayed=2, rescued=True) for i in range(5)]
        reply = client.report_outcomes(pool, "run", step, step // 2, outcomes, questions=[question("h0")])
        assert reply.recorded == 10


def test_export_then_import_keeps_every_history(replay_client, pool_name, tmp_path):
    fill(replay_client, pool_name)
    path = tmp_path / "pool.parquet"
    assert write_pool_rows(replay_client.export(pool_name, questions_per_chunk=2), path) == 5

    file = pq.ParquetFile(path)
    assert file.metadata.metadata[SCHEMA_KEY] == b"1"
    rows = file.read().to_pylist()
    assert sorted(r["extra_info"]["question_id"] for r in rows) == [f"s{i}" for i in range(5)]
    assert all(r["rlep_history"]["visits"] == 6 for r in rows)
    alone = read_history_only(file.metadata.metadata)  # no row: no success, and h1..h4 have no prompt to give
    assert sorted(h.question_id for _, h in alone) == [f"h{i}" for i in range(5)]
    assert {h.question_id: q for q, h in alone}["h0"] == question("h0")
    assert len(read_verl_parquet(path)) == 5  # still a training file: the rows verl reads are unchanged

    copy = pool_name + "-copy"
    try:
        reply = replay_client.import_chunks(read_pool_rows(check_pool_file(path), copy))
        assert (reply.added, reply.histories_imported, reply.histories_kept) == (5, 10, 0)
        original, imported = every_question(replay_client, pool_name), every_question(replay_client, copy)
        assert len(original) == 10 and imported == original  # every field, derived ones included
        before, after = replay_client.stats(pool_name), replay_client.stats(copy)
        for name in HISTORY_FIELDS + ("never_solved_questions", "replayed_rows", "history_settings"):
            assert getattr(after, name) == getattr(before, name), name
        assert after.rescues == 30 and after.history_reports == 0  # reports are not exported, their sums are

        again = replay_client.import_chunks(read_pool_rows(check_pool_file(path), copy))  # converges, keeps
        assert (again.added, again.histories_imported, again.histories_kept) == (0, 0, 10)
        assert every_question(replay_client, copy) == original
        second = tmp_path / "copy.parquet"
        write_pool_rows(replay_client.export(copy), second)
        alone_again = read_history_only(pq.ParquetFile(second).metadata.metadata)
        assert {h.question_id: q for q, h in alone_again}["h0"] == question("h0")  # its metadata came along
    finally:
        if copy in replay_client.list_pools():
            replay_client.drop(copy, confirm=copy)


def released_rows(count: int) -> list[dict]:
    return [
        {
            "data_source": "test",
            "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(i + 1), "style": "rule", "candidates": [f"\\boxed{{{i + 1}}}"]},
            "extra_info": {"index": i},
        }
        for i in range(count)
    ]


def test_files_without_history_still_import(replay_client, pool_name, tmp_path):
    released = tmp_path / "released.parquet"  # RLEP's format: no rlep_history, no metadata
    pq.write_table(pa.Table.from_pylist(released_rows(6)), released)
    before_history = tmp_path / "before.parquet"  # what this project wrote before history existed
    old_schema = pa.schema([f for f in POOL_SCHEMA if f.name != "rlep_history"])
    rows = [
        r | {"extra_info": {"index": r["extra_info"]["index"], "question_id": f"x{i}"}}
        for i, r in enumerate(released_rows(4))
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=old_schema), before_history)
    for path, count in ((released, 6), (before_history, 4)):
        reply = replay_client.import_chunks(read_pool_rows(check_pool_file(path), pool_name))
        assert (reply.added, reply.rejected, reply.histories_imported) == (count, 0, 0)
    stats = replay_client.stats(pool_name)
    assert (stats.trajectories, stats.questions_with_history) == (10, 0)


def test_a_later_or_damaged_history_is_refused_and_stores_nothing(replay_client, pool_name, tmp_path):
    fill(replay_client, pool_name)
    path = tmp_path / "pool.parquet"
    write_pool_rows(replay_client.export(pool_name), path)
    table = pq.read_table(path)
    later = tmp_path / "later.parquet"
    pq.write_table(table.replace_schema_metadata({SCHEMA_KEY: b"2"}), later)
    with pytest.raises(PoolFileError, match="history is schema 2"):
        check_pool_file(later)
    junk = tmp_path / "junk.parquet"
    pq.write_table(table.replace_schema_metadata({HISTORY_ONLY_KEY: b"not arrow"}), junk)
    with pytest.raises(PoolFileError, match="history-only part does not parse"):
        check_pool_file(junk)

    rows = table.to_pylist()
    rows[0]["rlep_history"]["successes"] = rows[0]["rlep_history"]["attempts"] + 1  # more successes than attempts
    damaged = tmp_path / "damaged.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=POOL_SCHEMA), damaged)
    target = pool_name + "-damaged"
    try:
        with pytest.raises(grpc.RpcError) as err:
            replay_client.import_chunks(read_pool_rows(check_pool_file(damaged), target))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more successes than attempts" in err.value.details()
        assert target not in replay_client.list_pools()  # the chunk was refused before its add
    finally:
        if target in replay_client.list_pools():  # the CI Redis is shared: leave nothing behind when this fails
            replay_client.drop(target, confirm=target)


def reporter(stub, acknowledged: list[int], enough: threading.Event) -> None:
    """Reports steps 1, 2, ... until the service stops answering; step k names question s<k> and "all"."""
    step = 0
    while True:
        step += 1
        request = replay_pb2.ReportOutcomesRequest(
            pool="durable", run_id="run", step=step, outcomes=[outcome("all", 4, 1), outcome(f"s{step}", 4, 2)]
        )
        try:
            stub.ReportOutcomes(request, timeout=10)
        except grpc.RpcError:
            enough.set()
            return
        acknowledged.append(step)
        if len(acknowledged) == 60:
            enough.set()


def test_kill_9_of_replay_and_its_redis_loses_no_acknowledged_report(tmp_path):
    data_dir = tmp_path / "redis"
    redis_server = start_local_redis(data_dir)  # AOF with appendfsync always, the embedded default
    service = start_service("replay", tmp_path / "replay.out", sets=[f"redis_url={redis_server.url}"])
    restarted = None
    try:
        with ReplayClient(service.address) as client:
            client.add("durable", [])
        channel = grpc.insecure_channel(service.address)
        acknowledged, enough = [], threading.Event()
        thread = threading.Thread(
            target=reporter, args=(replay_pb2_grpc.ReplayBufferStub(channel), acknowledged, enough)
        )
        thread.start()
        enough.wait(timeout=120)
        service.kill()  # SIGKILL while reports are in flight, then its Redis
        redis_server.kill()
        thread.join(timeout=60)
        channel.close()
        assert len(acknowledged) >= 60

        restarted = start_local_redis(data_dir, port=redis_server.port)
        service = start_service("replay", tmp_path / "replay2.out", sets=[f"redis_url={restarted.url}"])
        with ReplayClient(service.address) as client:
            found = {q.question_id: q for q in every_question(client, "durable")}
            assert all(f"s{step}" in found for step in acknowledged)
            # the one report in flight at the kill may have landed unacknowledged, never more
            assert len(acknowledged) <= found["all"].visits <= len(acknowledged) + 1
            last = found["all"].last_step
            assert client.report_outcomes("durable", "run", last, 0, [outcome("all", 4, 1)]).duplicate
            assert not client.report_outcomes("durable", "run", last + 1, 0, [outcome("all", 4, 1)]).duplicate
    finally:
        service.kill()
        (restarted or redis_server).stop()


def test_an_imported_window_longer_than_the_pools_keeps_its_last_visits(redis_url, replay_client, pool_name):
    """A pool whose window is 3 takes a history of 8 visits: its last 3 stay, and the pass rate is theirs."""
    import redis

    from rlep.services.replay.history import HistoryStore
    from rlep.services.replay.question_history import HistorySettings, QuestionRecord

    replay_client.add(pool_name, [])  # a new pool: its history starts with this store's settings
    store = HistoryStore(redis.Redis.from_url(redis_url), HistorySettings(3, 0.5, 0.9, 2), max_runs=10)
    record = QuestionRecord("q", 8, 32, 10, 0.0, 0.5, 1, 8, 0, 0, 0, 0, 0, 8, (4,) * 8, (0, 0, 0, 0, 0, 2, 4, 4))
    assert store.import_records(pool_name, [record, record]) == (1, 1)  # named twice in one call: the first counts
    (kept,) = store.records(pool_name, ["q"])
    assert kept.window_attempts == (4, 4, 4) and kept.window_successes == (2, 4, 4)
    assert (kept.visits, kept.attempts, kept.successes) == (8, 32, 10)  # all-time counts are the record's
    counters = store.counters(pool_name)
    assert counters.pass_rate_buckets[8] == 1 and counters.questions == 1  # 10/12 = 0.83
    assert counters.settings == HistorySettings(3, 0.5, 0.9, 2)


def test_rlep_pool_export_and_import_carry_the_history(replay, replay_client, pool_name, auth_token_file, tmp_path):
    from typer.testing import CliRunner

    from rlep.services.cli.app import app

    def rlep(*args: str) -> str:
        where = ["-a", f"127.0.0.1:{replay.port}", "--auth-token-file", str(auth_token_file)]
        result = CliRunner().invoke(app, ["pool", *args, *where])
        assert result.exit_code == 0, result.output
        return result.output

    fill(replay_client, pool_name)
    path = tmp_path / "pool.parquet"
    assert "wrote 5 questions" in rlep("export", pool_name, str(path))
    copy = pool_name + "-cli"
    try:
        assert "histories imported 10, kept 0" in rlep("import", str(path), "--pool", copy)
        assert every_question(replay_client, copy) == every_question(replay_client, pool_name)
    finally:
        if copy in replay_client.list_pools():
            replay_client.drop(copy, confirm=copy)
