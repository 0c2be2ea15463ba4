"""`RequestBytesInterceptor` on a real in-process gRPC server (loopback): large calls beyond the server's bound on
request bytes held get RESOURCE_EXHAUSTED at once, while the health check and a small call still answer; bytes
come back when calls end, a request stream holds only the message it is working on, a refused call is never
parsed, and health checks answer on threads of their own while every thread of the server's pool is held."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.grpc_server import add_validated_servicer, build_server
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc

SERVICE = replay_pb2.DESCRIPTOR.services_by_name["ReplayBuffer"]
MIB = 1024 * 1024
BIG = 900_000  # bytes of one large message: three fit the test server's 3 MiB bound, four do not
CALL_TIMEOUT_S = 30.0  # a held call waits for the test's gate, never this long


class HoldingReplay(replay_pb2_grpc.ReplayBufferServicer):
    """Large calls, and import streams after their first chunk, wait on `gate` with their request held."""

    def __init__(self):
        self.entered = threading.Semaphore(0)
        self.gate = threading.Event()
        self.parsed = 0  # AddTrajectories requests parsed (by `add_validated_servicer`, through `request_parsers`)
        self.request_parsers = {"AddTrajectories": self.parse_add}

    def parse_add(self, data: bytes) -> replay_pb2.AddTrajectoriesRequest:
        self.parsed += 1
        return replay_pb2.AddTrajectoriesRequest.FromString(data)

    def AddTrajectories(self, request, context):
        if request.ByteSize() > BIG // 2:
            self.entered.release()
            self.gate.wait(CALL_TIMEOUT_S)
        return replay_pb2.AddTrajectoriesResponse(added=len(request.questions))

    def ListPools(self, request, context):
        return replay_pb2.ListPoolsResponse(pools=["a"])

    def ImportPool(self, request_iterator, context):
        chunks = 0
        for _ in request_iterator:
            chunks += 1
            if chunks == 1:  # working on the large first chunk
                self.entered.release()
                self.gate.wait(CALL_TIMEOUT_S)
        return replay_pb2.AddTrajectoriesResponse(added=chunks)


def serve(config: ServerConfig) -> Iterator[tuple]:
    """(stub, health stub, servicer, AddTrajectories taking serialized bytes) of a server with `config`."""
    servicer = HoldingReplay()
    server, port, _ = build_server(
        config, lambda s: add_validated_servicer(s, SERVICE, servicer, config.max_request_bytes), [SERVICE.full_name]
    )
    channel = make_channel(f"127.0.0.1:{port}")
    raw_add = channel.unary_unary("/rlep.replay.v1.ReplayBuffer/AddTrajectories")  # no serializers: bytes in and out
    yield replay_pb2_grpc.ReplayBufferStub(channel), health_pb2_grpc.HealthStub(channel), servicer, raw_add
    servicer.gate.set()
    channel.close()
    server.stop(0)


@pytest.fixture
def served():
    yield from serve(ServerConfig(max_request_bytes=1 * MIB, max_inflight_request_bytes=3 * MIB))


@pytest.fixture
def served_on_two_threads():
    config = ServerConfig(max_request_bytes=1 * MIB, max_inflight_request_bytes=3 * MIB, grpc_threads=2)
    yield from serve(config)


def big_add() -> replay_pb2.AddTrajectoriesRequest:
    return replay_pb2.AddTrajectoriesRequest(pool="p", questions=[replay_pb2.Question(ground_truth="x" * BIG)])


def wait_entered(servicer: HoldingReplay, calls: int) -> None:
    for _ in range(calls):
        assert servicer.entered.acquire(timeout=CALL_TIMEOUT_S), "a large call never reached its handler"


def assert_health_and_small_call_answer(stub, health) -> None:
    started = time.monotonic()
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() - started < 1.0
    assert list(stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=5).pools) == ["a"]
    small = replay_pb2.AddTrajectoriesRequest(pool="p", questions=[replay_pb2.Question(ground_truth="42")])
    assert stub.AddTrajectories(small, timeout=5).added == 1


def test_large_calls_beyond_the_bound_are_refused_while_health_and_small_calls_answer(served):
    stub, health, servicer, _ = served
    held = [stub.AddTrajectories.future(big_add(), timeout=CALL_TIMEOUT_S) for _ in range(3)]
    wait_entered(servicer, 3)  # 3 x 0.9 MB held of 3 MiB
    with pytest.raises(grpc.RpcError) as refused:
        stub.AddTrajectories(big_add(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_inflight_request_bytes" in refused.value.details()
    assert_health_and_small_call_answer(stub, health)
    servicer.gate.set()
    assert [call.result().added for call in held] == [1, 1, 1]
    assert stub.AddTrajectories(big_add(), timeout=5).added == 1  # the bytes came back


def test_a_request_stream_holds_the_message_it_works_on(served):
    stub, health, servicer, _ = served
    first = replay_pb2.PoolChunk(pool="p", questions=[replay_pb2.Question(ground_truth="x" * BIG)])

    def chunks() -> Iterator[replay_pb2.PoolChunk]:
        yield first
        yield from (replay_pb2.PoolChunk(pool="p", questions=[replay_pb2.Question(ground_truth="1")]) for _ in range(3))

    imports = [stub.ImportPool.future(chunks(), timeout=CALL_TIMEOUT_S) for _ in range(3)]
    wait_entered(servicer, 3)  # each stream works on its 0.9 MB first chunk
    with pytest.raises(grpc.RpcError) as refused:
        stub.AddTrajectories(big_add(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_health_and_small_call_answer(stub, health)
    servicer.gate.set()
    assert [call.result().added for call in imports] == [4, 4, 4]
    assert stub.AddTrajectories(big_add(), timeout=5).added == 1  # each stream gave its chunk's bytes back


def malformed_big_add() -> bytes:
    """A serialized AddTrajectories of BIG bytes that protobuf refuses to parse (invalid UTF-8 in a string)."""
    data = big_add().SerializeToString()
    at = data.index(b"x" * BIG)
    return data[:at] + b"\xff" + data[at + 1 :]


def test_a_refused_call_is_never_parsed_and_an_admitted_one_is(served):
    stub, _, servicer, raw_add = served
    held = [stub.AddTrajectories.future(big_add(), timeout=CALL_TIMEOUT_S) for _ in range(3)]
    wait_entered(servicer, 3)
    parsed = servicer.parsed
    with pytest.raises(grpc.RpcError) as refused:
        raw_add(malformed_big_add(), timeout=5)
    # Refused on its size alone: a parse would have answered INVALID_ARGUMENT.
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert servicer.parsed == parsed
    servicer.gate.set()
    assert [call.result().added for call in held] == [1, 1, 1]
    with pytest.raises(grpc.RpcError) as malformed:
        raw_add(malformed_big_add(), timeout=5)
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # admitted, then parsed
    assert servicer.parsed == parsed + 1


def test_health_answers_while_every_thread_of_the_pool_is_held(served_on_two_threads):
    stub, health, servicer, _ = served_on_two_threads
    held = [stub.AddTrajectories.future(big_add(), timeout=CALL_TIMEOUT_S) for _ in range(2)]
    wait_entered(servicer, 2)  # both of the server's threads wait on the gate
    started = time.monotonic()
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() - started < 1.0
    servicer.gate.set()
    assert [call.result().added for call in held] == [1, 1]


def test_a_request_over_max_request_bytes_is_refused_before_it_is_parsed(served):
    """Its size is the bytes received: a parse (or a re-encode to measure it) of a 60 MB request would hold the GIL
    while health checks wait (issue 46's mixed load)."""
    stub, _, servicer, raw_add = served
    over = replay_pb2.AddTrajectoriesRequest(pool="p", questions=[replay_pb2.Question(ground_truth="x" * MIB)])
    with pytest.raises(grpc.RpcError) as refused:
        raw_add(over.SerializeToString(), timeout=5)
    size = over.ByteSize()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == f"request is {size} bytes, over the limit of {MIB}; split it"
    assert servicer.parsed == 0
    small = replay_pb2.AddTrajectoriesRequest(pool="p", questions=[replay_pb2.Question(ground_truth="42")])
    assert stub.AddTrajectories(small, timeout=5).added == 1 and servicer.parsed == 1  # within the limit: parsed
