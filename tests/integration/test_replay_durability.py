"""Durability and failure: kill -9 of Redis after acknowledged adds, and a Redis that goes away."""

from __future__ import annotations

import grpc
import pytest

from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2
from rlep_common.config import ServerConfig
from rlep_common.redis_server import start_local_redis
from rlep_common.types import Trajectory, Verdict
from services.replay.client import ReplayClient
from services.replay.config import ReplayConfig
from services.replay.main import start_replay

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


def test_redis_going_away_gives_unavailable_and_no_partial_write(tmp_path):
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
                assert "retry" in err.value.details()
            revived = start_local_redis(tmp_path / "redis", port=redis_server.port)
            try:
                assert client.stats("p").trajectories == 10  # nothing half-written
                assert client.add("p", successes(10, 5)).added == 5  # and the retry goes through
            finally:
                revived.stop()
    finally:
        running.stop()
