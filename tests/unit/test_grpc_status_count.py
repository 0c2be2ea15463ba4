"""`StatusCountInterceptor`: every call counted once, by method and the status code its caller saw, on a real
in-process gRPC server (unary, client-streaming and server-streaming handlers; aborts, `set_code`, exceptions,
a caller that goes away mid-stream)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.grpc_interceptors import StatusCountInterceptor
from rlep.common.grpc_server import add_validated_servicer, build_server
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc

SERVICE = replay_pb2.DESCRIPTOR.services_by_name["ReplayBuffer"]


class FakeReplay(replay_pb2_grpc.ReplayBufferServicer):
    """Each method ends its call a different way."""

    def __init__(self):
        self.export_closed = threading.Event()

    def ListPools(self, request, context):
        return replay_pb2.ListPoolsResponse(pools=["a"])

    def DropPool(self, request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")

    def GetPoolStats(self, request, context):
        context.set_code(grpc.StatusCode.NOT_FOUND)  # returns normally after setting a code
        context.set_details("missing")
        return replay_pb2.PoolStats()

    def Sample(self, request, context):
        raise RuntimeError("a bug")

    def ImportPool(self, request_iterator, context):
        return replay_pb2.AddTrajectoriesResponse(added=sum(1 for _ in request_iterator))

    def ExportPool(self, request, context):
        try:
            yield replay_pb2.PoolChunk(pool=request.pool)
            if request.pool == "full":
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too big")
            if request.pool == "endless":
                while True:
                    yield replay_pb2.PoolChunk(pool=request.pool)
                    time.sleep(0.01)  # paces the stream; the test waits on export_closed, not on time
            yield replay_pb2.PoolChunk(pool=request.pool)
        finally:
            self.export_closed.set()


@pytest.fixture
def served():
    counter = Counter("rlep_test_requests_total", "calls", ["method", "code"], registry=CollectorRegistry())
    servicer = FakeReplay()
    server, port, _ = build_server(
        ServerConfig(),
        lambda s: add_validated_servicer(s, SERVICE, servicer, 1 << 20),
        [SERVICE.full_name],
        [StatusCountInterceptor(counter, SERVICE.full_name)],
    )
    channel = make_channel(f"127.0.0.1:{port}")
    yield replay_pb2_grpc.ReplayBufferStub(channel), counter, servicer, channel
    channel.close()
    server.stop(0)


def counts(counter: Counter) -> dict[tuple[str, str], float]:
    return {
        (s.labels["method"], s.labels["code"]): s.value
        for metric in counter.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


def code_of(call, request) -> grpc.StatusCode:
    try:
        result = call(request, timeout=10)
        if hasattr(result, "__iter__") and not hasattr(result, "ByteSize"):
            list(result)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_each_call_is_counted_once_with_the_code_its_caller_saw(served):
    stub, counter, _, channel = served
    seen = {
        "ListPools": code_of(stub.ListPools, replay_pb2.ListPoolsRequest()),
        "DropPool": code_of(stub.DropPool, replay_pb2.DropPoolRequest()),
        "GetPoolStats": code_of(stub.GetPoolStats, replay_pb2.GetPoolStatsRequest()),
        "Sample": code_of(stub.Sample, replay_pb2.SampleRequest()),
        "ImportPool": code_of(stub.ImportPool, iter([replay_pb2.PoolChunk(pool="p")] * 3)),
    }
    export = {pool: code_of(stub.ExportPool, replay_pb2.ExportPoolRequest(pool=pool)) for pool in ("ok", "full")}
    assert seen == {
        "ListPools": grpc.StatusCode.OK,
        "DropPool": grpc.StatusCode.INVALID_ARGUMENT,
        "GetPoolStats": grpc.StatusCode.NOT_FOUND,
        "Sample": grpc.StatusCode.UNKNOWN,
        "ImportPool": grpc.StatusCode.OK,
    }
    assert export == {"ok": grpc.StatusCode.OK, "full": grpc.StatusCode.RESOURCE_EXHAUSTED}
    # A malformed request is refused while parsing, inside the counted handler.
    raw = channel.unary_unary(f"/{SERVICE.full_name}/ListPools")
    assert code_of(raw, b"\xff") == grpc.StatusCode.INVALID_ARGUMENT
    # The health service is someone else's: not counted.
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert counts(counter) == {
        ("ListPools", "OK"): 1,
        ("ListPools", "INVALID_ARGUMENT"): 1,
        ("DropPool", "INVALID_ARGUMENT"): 1,
        ("GetPoolStats", "NOT_FOUND"): 1,
        ("Sample", "UNKNOWN"): 1,
        ("ImportPool", "OK"): 1,
        ("ExportPool", "OK"): 1,
        ("ExportPool", "RESOURCE_EXHAUSTED"): 1,
    }


def test_a_stream_its_caller_abandons_counts_as_cancelled(served):
    stub, counter, servicer, _ = served
    stream = stub.ExportPool(replay_pb2.ExportPoolRequest(pool="endless"), timeout=30)
    next(stream)
    stream.cancel()
    assert servicer.export_closed.wait(timeout=10)
    deadline = time.monotonic() + 10  # the count lands as the server unwinds the stream
    while not counts(counter) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counts(counter) == {("ExportPool", "CANCELLED"): 1}


def test_a_counter_without_method_label_counts_by_code_only():
    counter = Counter("rlep_test_calls_total", "calls", ["code"], registry=CollectorRegistry())
    servicer = FakeReplay()
    server, port, _ = build_server(
        ServerConfig(),
        lambda s: add_validated_servicer(s, SERVICE, servicer, 1 << 20),
        [SERVICE.full_name],
        [StatusCountInterceptor(counter, SERVICE.full_name, by_method=False)],
    )
    try:
        stub = replay_pb2_grpc.ReplayBufferStub(make_channel(f"127.0.0.1:{port}"))
        stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=10)
        code_of(stub.DropPool, replay_pb2.DropPoolRequest())
    finally:
        server.stop(0)
    assert counter.labels("OK")._value.get() == 1 and counter.labels("INVALID_ARGUMENT")._value.get() == 1
