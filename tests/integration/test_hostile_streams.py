"""Idle request streams cannot stall a service (issue 31, item 1): before, 16 `ImportPool` (replay) or
`UpdateWeights` (rollout) calls that opened, sent nothing and set no deadline took all 16 handler threads, and the
health check and every other call timed out behind them for as long as they stayed open."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.integration
IDLE_TIMEOUT_S = 2.0
ANSWER_WITHIN_S = 1.0


class Silent:
    """A request iterator that sends nothing until released: a stream opened and left idle, with no deadline."""

    def __init__(self, release: threading.Event):
        self._release = release

    def __iter__(self):
        return self

    def __next__(self):
        self._release.wait()
        raise StopIteration


def open_idle_streams(method, count: int, release: threading.Event, admitted: int) -> list[grpc.Future]:
    """`count` idle streams, returned once all but `admitted` of them have been answered (refused)."""
    answered = threading.Semaphore(0)
    streams = [method.future(Silent(release)) for _ in range(count)]
    for stream in streams:
        stream.add_done_callback(lambda _: answered.release())
    for _ in range(count - admitted):
        assert answered.acquire(timeout=30), "the streams beyond the method's slots were not refused"
    return streams


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def settled(calls: list[grpc.Future], within_s: float) -> dict[grpc.StatusCode, int]:
    codes: dict[grpc.StatusCode, int] = {}
    for call in calls:
        error = call.exception(timeout=within_s)
        code = error.code() if error is not None else grpc.StatusCode.OK
        codes[code] = codes.get(code, 0) + 1
    return codes


@pytest.fixture
def replay_address(redis_url):
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.replay.main import start_replay

    server = ServerConfig(port=0, stream_idle_timeout_s=IDLE_TIMEOUT_S)
    running = start_replay(ReplayConfig(server=server, redis_url=redis_url))
    yield f"127.0.0.1:{running.port}"
    running.stop()


@pytest.mark.parametrize("hostile", [16, 64])
def test_idle_import_streams_leave_replay_answering_and_are_cancelled(replay_address, hostile):
    channel = make_channel(replay_address)
    stub, health = replay_pb2_grpc.ReplayBufferStub(channel), health_pb2_grpc.HealthStub(channel)
    release = threading.Event()
    hostile_stub = replay_pb2_grpc.ReplayBufferStub(make_channel(replay_address))
    try:
        # 4 streams (a quarter of 16 threads) are admitted and held; the rest are refused at once.
        streams = open_idle_streams(hostile_stub.ImportPool, hostile, release, admitted=4)
        latencies = [timed(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)) for _ in range(5)]
        latencies += [timed(lambda: stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=5)) for _ in range(5)]
        assert max(latencies) < ANSWER_WITHIN_S, latencies
        # The admitted ones are cancelled once idle for the timeout: no thread stays held.
        codes = settled(streams, within_s=IDLE_TIMEOUT_S + 10)
        assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED: hostile - 4, grpc.StatusCode.CANCELLED: 4}, codes
    finally:
        release.set()
    # The slots are free again: an import goes through.
    stub.ImportPool(iter([replay_pb2.PoolChunk(pool="after-storm")]), timeout=10)
    assert "after-storm" in stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=5).pools


@pytest.mark.parametrize("hostile", [16, 64])
def test_idle_weight_streams_leave_a_rollout_replica_serving(rollout, auth_token_file, hostile):
    """The session's replica (default idle timeout, 30 s): the test cancels its streams itself when done."""
    channel = make_channel(f"127.0.0.1:{rollout.port}", auth_token_file.read_text().strip())
    stub, health = rollout_pb2_grpc.RolloutStub(channel), health_pb2_grpc.HealthStub(channel)
    release = threading.Event()
    streams = open_idle_streams(stub.UpdateWeights, hostile, release, admitted=4)
    try:
        latencies = [timed(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)) for _ in range(5)]
        latencies += [timed(lambda: stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=5)) for _ in range(5)]
        assert max(latencies) < ANSWER_WITHIN_S, latencies
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(text="Q: 1+1=?\nA: ")],
            sampling=rollout_pb2.SamplingOptions(n=1, temperature=0.0, max_tokens=4),
        )
        assert stub.Generate(request, timeout=30).completions[0].samples[0].token_ids
        refused = [s for s in streams if s.done()]
        assert len(refused) == hostile - 4
        assert all(s.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED for s in refused)
    finally:
        for stream in streams:
            stream.cancel()
        release.set()
    # Cancelled by their client, the held streams free their slots: the replica takes a stream again at once.
    deadline = time.monotonic() + 10
    while True:
        call = stub.UpdateWeights.future(iter([]))
        error = call.exception(timeout=10)
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            break
        assert time.monotonic() < deadline, "the cancelled streams kept their slots"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # an empty stream: refused for what it is
