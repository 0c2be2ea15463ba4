"""Streams cannot hold replay's threads however they misbehave (issue 46, items 1 and 2): before, 16 `ExportPool`
calls whose client never read held every handler thread (the health check and ListPools timed out), and
`ImportPool` streams sending a chunk of nothing just under the idle timeout lived as long as they liked and held
every import slot. Also: every `ReplayClient` call carries a deadline, streams included."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.stream_guard import WATCH_PERIOD_S
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.services.replay.client import ReplayClient

pytestmark = pytest.mark.integration
IDLE_TIMEOUT_S = 2.0
MAX_DURATION_S = 6.0
ANSWER_WITHIN_S = 1.0
SLOTS = 4  # a quarter of the default 16 threads
# An export several times larger than what HTTP/2 flow control and the loopback socket buffers let through unread.
EXPORT_QUESTIONS, TRAJECTORIES_PER_QUESTION, TEXT_BYTES = 40, 8, 64 * 1024


def trajectory(qid: str, i: int, text_bytes: int = 0) -> trajectory_pb2.Trajectory:
    return trajectory_pb2.Trajectory(
        question_id=qid, response_text=f"answer {i} " + "x" * text_bytes, reward=1.0, verdict=trajectory_pb2.CORRECT
    )


@pytest.fixture
def replay(redis_url):
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.replay.main import start_replay

    server = ServerConfig(port=0, stream_idle_timeout_s=IDLE_TIMEOUT_S, stream_max_duration_s=MAX_DURATION_S)
    running = start_replay(ReplayConfig(server=server, redis_url=redis_url))
    address = f"127.0.0.1:{running.port}"
    pools: list[str] = []
    yield address, pools
    stub = replay_pb2_grpc.ReplayBufferStub(make_channel(address))
    for pool in pools:
        stub.DropPool(replay_pb2.DropPoolRequest(pool=pool, confirm=pool), timeout=30)
    running.stop()


def new_pool(pools: list[str]) -> str:
    pools.append(f"test-streams-{uuid.uuid4().hex[:8]}")
    return pools[-1]


def answer_latencies(address: str) -> list[float]:
    channel = make_channel(address)
    stub, health = replay_pb2_grpc.ReplayBufferStub(channel), health_pb2_grpc.HealthStub(channel)
    latencies = []
    for call in [lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)] * 5 + [
        lambda: stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=5)
    ] * 5:
        started = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - started)
    return latencies


def wait_refused(calls: list, refused: int) -> None:
    """Returns once `refused` of `calls` have ended (those beyond the method's slots end at once)."""
    ended = threading.Semaphore(0)
    for call in calls:
        call.add_done_callback(lambda _: ended.release())
    for _ in range(refused):
        assert ended.acquire(timeout=30), "the streams beyond the method's slots were not refused"


def codes_within(calls: list, within_s: float) -> dict[grpc.StatusCode, int]:
    codes: dict[grpc.StatusCode, int] = {}
    deadline = time.monotonic() + within_s
    for call in calls:
        error = call.exception(timeout=max(0.0, deadline - time.monotonic()))
        code = error.code() if error is not None else grpc.StatusCode.OK
        codes[code] = codes.get(code, 0) + 1
    return codes


@pytest.mark.parametrize("hostile", [16])
def test_exports_nobody_reads_leave_replay_answering_and_are_cancelled(replay, hostile):
    address, pools = replay
    pool = new_pool(pools)
    stub = replay_pb2_grpc.ReplayBufferStub(make_channel(address))
    for q in range(EXPORT_QUESTIONS):
        qid = f"q{q}"
        items = [trajectory(qid, i, TEXT_BYTES) for i in range(TRAJECTORIES_PER_QUESTION)]
        stub.AddTrajectories(replay_pb2.AddTrajectoriesRequest(pool=pool, trajectories=items), timeout=30)
    # One connection that never grows its flow-control window: an exporter that is stuck, or half open.
    stuck = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    hostile_stub = replay_pb2_grpc.ReplayBufferStub(stuck)
    request = replay_pb2.ExportPoolRequest(pool=pool, questions_per_chunk=4)
    exports = [hostile_stub.ExportPool(request) for _ in range(hostile)]  # started, never read
    try:
        wait_refused(exports, refused=hostile - SLOTS)
        latencies = answer_latencies(address)
        assert max(latencies) < ANSWER_WITHIN_S, latencies
        # The admitted ones cannot write for the idle timeout: cancelled, their threads and slots back. (Their client,
        # never reading, never sees that: gRPC gives it the status after the messages.)
        freed_by = time.monotonic() + IDLE_TIMEOUT_S + 2 * WATCH_PERIOD_S + 1
        while (code := export_code(address, pool)) == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert time.monotonic() < freed_by, "the stuck exports kept their slots"
            threading.Event().wait(0.05)  # poll interval
        assert code == grpc.StatusCode.OK
    finally:
        for export in exports:
            export.cancel()
        stuck.close()
    # Every slot is free: as many honest exports as slots, at once, all read the whole pool.
    with futures.ThreadPoolExecutor(SLOTS) as pool_of_readers:
        codes = list(pool_of_readers.map(lambda _: export_code(address, pool), range(SLOTS)))
    assert codes == [grpc.StatusCode.OK] * SLOTS


def export_code(address: str, pool: str) -> grpc.StatusCode:
    """How an honest export of the whole pool ends (OK only when every trajectory came)."""
    try:
        with ReplayClient(address, stream_timeout_s=30) as client:
            exported = list(client.export(pool))
    except grpc.RpcError as err:
        return err.code()
    assert sum(len(c.trajectories) for c in exported) == EXPORT_QUESTIONS * TRAJECTORIES_PER_QUESTION
    return grpc.StatusCode.OK


class Trickle:
    """An import stream that names its pool, then sends a `kind` chunk every 0.8 x the idle timeout until released."""

    def __init__(self, pool: str, kind: str, release: threading.Event):
        self._pool, self._kind, self._release, self._sent = pool, kind, release, 0

    def __iter__(self):
        return self

    def __next__(self) -> replay_pb2.PoolChunk:
        self._sent += 1
        if self._sent == 1:
            return replay_pb2.PoolChunk(pool=self._pool)
        if self._release.wait(0.8 * IDLE_TIMEOUT_S):
            raise StopIteration
        return trickle_chunk(self._kind, self._pool, self._sent)


def honest_import(stub, pool: str, qid: str) -> replay_pb2.AddTrajectoriesResponse:
    chunk = replay_pb2.PoolChunk(pool=pool, trajectories=[trajectory(qid, 0)])
    return stub.ImportPool(iter([chunk]), timeout=10)


def trickle_chunk(kind: str, pool: str, sent: int) -> replay_pb2.PoolChunk:
    if kind == "empty":
        return replay_pb2.PoolChunk()
    if kind == "pool-only":
        return replay_pb2.PoolChunk(pool=pool)
    return replay_pb2.PoolChunk(trajectories=[trajectory(f"t{sent}", sent)])


@pytest.mark.parametrize(
    ("kind", "ended_within_s"),
    [
        # Chunks that carry nothing are no progress: ended by the idle timeout, counted from the first wait.
        ("empty", IDLE_TIMEOUT_S + 2),
        ("pool-only", IDLE_TIMEOUT_S + 2),
        # A trajectory each time is progress: ended by the total-duration bound.
        ("one-trajectory", MAX_DURATION_S + 2),
    ],
)
def test_trickling_imports_end_and_honest_imports_get_slots(replay, kind, ended_within_s):
    address, pools = replay
    pool = new_pool(pools)
    stub = replay_pb2_grpc.ReplayBufferStub(make_channel(address))
    release = threading.Event()
    started = time.monotonic()
    trickles = [stub.ImportPool.future(Trickle(pool, kind, release)) for _ in range(SLOTS)]
    try:
        codes = codes_within(trickles, within_s=ended_within_s + 10)
        lived_s = time.monotonic() - started
    finally:
        release.set()
    assert codes == {grpc.StatusCode.CANCELLED: SLOTS}, codes
    assert lived_s < ended_within_s, lived_s
    for i in range(3 * SLOTS):  # the slots are free again
        assert honest_import(stub, pool, f"honest{i}").added == 1


def test_every_client_call_has_a_deadline():
    """Against a server that never answers (half open, or stuck), each call ends by its deadline."""
    never = threading.Event()

    class Stuck(replay_pb2_grpc.ReplayBufferServicer):
        def ListPools(self, request, context):
            never.wait()
            return replay_pb2.ListPoolsResponse()

        def ExportPool(self, request, context):
            never.wait()
            yield replay_pb2.PoolChunk()

        def ImportPool(self, request_iterator, context):
            never.wait()
            return replay_pb2.AddTrajectoriesResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    replay_pb2_grpc.add_ReplayBufferServicer_to_server(Stuck(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    calls = {
        "list_pools": lambda c: c.list_pools(),
        "export": lambda c: list(c.export("p")),
        "import_chunks": lambda c: c.import_chunks([replay_pb2.PoolChunk(pool="p")]),
    }
    client = ReplayClient(f"127.0.0.1:{port}", timeout_s=0.5, stream_timeout_s=0.5)
    callers = futures.ThreadPoolExecutor(len(calls))
    try:
        ended = {name: callers.submit(call, client) for name, call in calls.items()}
        for name, future in ended.items():
            # list_pools retries a DEADLINE_EXCEEDED (3 tries in all): 1.5 s
            error = future.exception(timeout=5)  # a call without a deadline would still be waiting
            assert isinstance(error, grpc.RpcError), name
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, name
    finally:
        never.set()
        server.stop(None)
        callers.shutdown()
        client.close()
