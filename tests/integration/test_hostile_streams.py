"""Idle request streams cannot stall a service (issue 31, item 1): before, 16 `ImportPool` (replay) or
`UpdateWeights` (rollout) calls that opened, sent nothing and set no deadline took all 16 handler threads, and the
health check and every other call timed out behind them for as long as they stayed open."""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.replay.client import ReplayClient
from tests.service_process import start_service
from tests.silent_stream import Silent

pytestmark = pytest.mark.integration
IDLE_TIMEOUT_S = 2.0
ANSWER_WITHIN_S = 1.0


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


class Trickle:
    """An ImportPool stream naming its pool, then sending an empty chunk every `every_s` until released."""

    def __init__(self, every_s: float, release: threading.Event):
        self._every_s, self._release, self._sent = every_s, release, 0

    def __iter__(self):
        return self

    def __next__(self):
        self._sent += 1
        if self._sent > 1 and self._release.wait(self._every_s):
            raise StopIteration
        return replay_pb2.PoolChunk(pool="trickle" if self._sent == 1 else "")


def add_request(pool: str, question: str, texts: list[str]) -> replay_pb2.AddTrajectoriesRequest:
    rows = [trajectory_pb2.Trajectory(question_id=question, response_text=t, reward=1.0, verdict=1) for t in texts]
    return replay_pb2.AddTrajectoriesRequest(pool=pool, trajectories=rows)


CROWD_S = 6.0
ADD = "/rlep.replay.v1.ReplayBuffer/AddTrajectories"
REQUEST_BYTES = 2 << 20  # the service's max_request_bytes: 4 MiB in flight, so two large adds fill the bound


def crowd(address: str, stop_at: float, codes: dict[str, Counter]) -> list[threading.Thread]:
    """16 each of: ~1.9 MB adds, exports of a 1.5 MB pool nobody reads, imports trickling empty chunks every 0.8 x the
    idle timeout, plain calls; each in a loop until `stop_at`, its status codes counted in `codes[kind]`."""
    big = add_request("big", "big", [f"{i} " + "y" * 237_000 for i in range(8)]).SerializeToString()
    stuck = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])  # a window that never grows
    never, lock = threading.Event(), threading.Lock()  # tricklers trickle until the server cancels them

    def outcome(call) -> str:
        try:
            call()
            return "OK"
        except grpc.RpcError as err:
            return err.code().name

    def ended(call) -> str:
        while not call.done() and time.monotonic() < stop_at:
            time.sleep(0.05)
        if call.done():
            return call.code().name
        call.cancel()
        return "open at the end"

    def loop(kind: str) -> None:
        channel = grpc.insecure_channel(address)
        stub = replay_pb2_grpc.ReplayBufferStub(channel)
        calls = {
            "big adds": lambda: outcome(lambda: channel.unary_unary(ADD)(big, timeout=10)),
            "unread exports": lambda: ended(
                replay_pb2_grpc.ReplayBufferStub(stuck).ExportPool(replay_pb2.ExportPoolRequest(pool="export"))
            ),
            "tricklers": lambda: ended(stub.ImportPool.future(Trickle(0.8 * IDLE_TIMEOUT_S, never))),
            "plain calls": lambda: outcome(lambda: stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=10)),
        }
        while time.monotonic() < stop_at:
            code = calls[kind]()
            with lock:
                codes[kind][code] += 1

    return [threading.Thread(target=loop, args=(kind,)) for kind in codes for _ in range(16)]


def test_a_mixed_crowd_of_64_leaves_replay_answering_and_an_honest_client_served(tmp_path):
    """Issue 46's mixed load, small: 64 callers at once against `rlep serve replay` (2 MiB requests, 4 MiB in flight,
    a 2 s idle timeout) beside an honest client and a health probe: health answers within 1 s throughout, every honest
    call succeeds, large adds past the bound on bytes in flight and streams past the slots are refused."""
    sets = [
        f"local_redis_dir={tmp_path / 'redis'}",
        f"server.max_request_bytes={REQUEST_BYTES}",
        f"max_sample_bytes={REQUEST_BYTES // 2}",  # a Sample reply must fit the send limit
        f"server.stream_idle_timeout_s={IDLE_TIMEOUT_S}",
    ]
    replay = start_service("replay", tmp_path / "replay.out", sets=sets)
    stub = replay_pb2_grpc.ReplayBufferStub(make_channel(replay.address))
    health = health_pb2_grpc.HealthStub(make_channel(replay.address))
    for q in range(12):
        stub.AddTrajectories(add_request("export", f"q{q}", [f"{i} " + "x" * 16_000 for i in range(8)]), timeout=10)
    codes = {kind: Counter() for kind in ("big adds", "unread exports", "tricklers", "plain calls")}
    stop_at = time.monotonic() + CROWD_S
    threads = crowd(replay.address, stop_at, codes)
    probes, honest = [], Counter()
    try:
        for thread in threads:
            thread.start()
        with ReplayClient(replay.address, timeout_s=5) as client:
            ordinary = [client.list_pools, lambda: client.stats("export"), lambda: client.sample("export", ["q0"], 1)]
            n = 0
            while time.monotonic() < stop_at:
                probes.append(timed(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)))
                try:
                    ordinary[n % 3]()
                    honest["OK"] += 1
                except grpc.RpcError as err:
                    honest[err.code().name] += 1
                n += 1
                time.sleep(0.05)
        for thread in threads:
            thread.join(timeout=30)
    finally:
        replay.stop()
    assert max(probes) < ANSWER_WITHIN_S, sorted(probes)[-5:]
    assert set(honest) == {"OK"} and honest["OK"] > 5, honest
    assert codes["big adds"]["RESOURCE_EXHAUSTED"] > 0 and codes["big adds"]["OK"] > 0, codes
    # Exports past the 4 slots are refused; the cancellation of the stalled ones is test_stream_bounds.py's.
    assert codes["unread exports"]["RESOURCE_EXHAUSTED"] > 0, codes
    assert codes["tricklers"]["RESOURCE_EXHAUSTED"] > 0 and codes["tricklers"]["CANCELLED"] > 0, codes
