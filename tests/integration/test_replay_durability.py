"""Durability and failure: kill -9 of Redis after acknowledged adds, a Redis that goes away, a full Redis."""

from __future__ import annotations

import logging

import grpc
import pytest

from rlep.common.config import ServerConfig
from rlep.common.redis_server import start_local_redis
from rlep.common.types import Trajectory, Verdict
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2
from rlep.services.replay.client import ReplayClient
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.main import start_replay

pytestmark = pytest.mark.integration


def successes(start: int, count: int) -> list[Trajectory]:
    return [Trajectory(f"q{i % 50}", f"answer {i}", 1.0, verdict=Verdict.CORRECT) for i in range(start, start + count)]


def test_kill_9_after_acknowledged_adds_loses_nothing(tmp_path):
    data_dir = tmp_path / "redis"
    redis_server = start_local_redis(data_dir)  # AOF with appendfsync always
    running = start_replay(ReplayConfig(server=ServerConfig(port=0), redis_url=redis_server.url))
    acknowledged = 0
    try:
        with ReplayClient(f"127.0.0.1:{running.port}") as client:
            for start in range(0, 1000, 100):
                acknowledged += client.add("durable", successes(start, 100)).added
            before = client.stats("durable")
            first_sample = client.sample("durable", [f"q{i}" for i in range(50)], m=3, seed=1)
        redis_server.kill()  # SIGKILL right after the last acknowledged add
    finally:
        running.stop()
    assert acknowledged == 1000

    restarted = start_local_redis(data_dir, port=redis_server.port)
    running = start_replay(ReplayConfig(server=ServerConfig(port=0), redis_url=restarted.url))
    try:
        with ReplayClient(f"127.0.0.1:{running.port}") as client:
            after = client.stats("durable")
            assert after.trajectories == 1000 and after.questions == 50
            assert after.successes_per_question == before.successes_per_question
            assert client.sample("durable", [f"q{i}" for i in range(50)], m=3, seed=1) == first_sample
    finally:
        running.stop()
        restarted.stop()


def redis_log(caplog, phrase: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rlep.services.replay" and phrase in r.getMessage()]


def test_redis_going_away_gives_unavailable_and_no_partial_write(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlep.services.replay")
    redis_server = start_local_redis(tmp_path / "redis")
    config = ReplayConfig(server=ServerConfig(port=0), redis_url=redis_server.url, redis_timeout_s=2.0)
    running = start_replay(config)
    try:
        with ReplayClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            client.add("p", successes(0, 10))
            redis_server.kill()
            new = trajectory_pb2.Trajectory(question_id="q1", response_text="new", verdict=trajectory_pb2.CORRECT)
            request = replay_pb2.AddTrajectoriesRequest(pool="p", trajectories=[new])
            for call, message in (
                (client.stub.AddTrajectories, request),
                (client.stub.Sample, replay_pb2.SampleRequest(pool="p", question_ids=["q1"], m=2)),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(message, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                # A timed-out add may have been applied: the message must not promise otherwise.
                assert "may or may not have taken effect" in err.value.details()
                assert "Retrying is safe: adds are idempotent" in err.value.details()
            assert len(redis_log(caplog, "Redis unreachable")) == 1  # once per outage, not per call
            assert not [r for r in caplog.records if r.exc_info]  # and no traceback
            revived = start_local_redis(tmp_path / "redis", port=redis_server.port)
            try:
                assert client.stats("p").trajectories == 10  # nothing half-written
                assert client.add("p", successes(10, 5)).added == 5  # and the retry goes through
            finally:
                revived.stop()
            assert len(redis_log(caplog, "Redis works again (was unreachable)")) == 1
    finally:
        running.stop()


def test_a_full_redis_gives_resource_exhausted_logged_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlep.services.replay")
    redis_server = start_local_redis(
        tmp_path / "redis",
        appendfsync="everysec",
        extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"],
    )
    running = start_replay(ReplayConfig(server=ServerConfig(port=0), redis_url=redis_server.url))
    try:
        with ReplayClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            failures, acknowledged = [], 0
            big = [Trajectory(f"q{i}", f"{i} " + "x" * 100_000, 1.0, verdict=Verdict.CORRECT) for i in range(80)]
            for start in range(0, 80, 4):
                try:
                    acknowledged += client.add("full", big[start : start + 4]).added
                except grpc.RpcError as err:
                    failures.append((err.code(), err.details()))
            assert acknowledged > 0 and len(failures) >= 2, (acknowledged, failures)
            for code, details in failures:
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "Redis is out of memory" in details and "nothing was stored" in details
            assert len(redis_log(caplog, "Redis out of memory")) == 1
            assert client.stats("full").trajectories == acknowledged  # every refused add stored nothing
            assert len(client.sample("full", ["q0"], m=1)["q0"]) == 1  # reads still work
    finally:
        running.stop()
        redis_server.stop()
