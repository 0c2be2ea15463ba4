"""The health port (`server.health_port`): a second gRPC server answering health checks with what the data port's
own health check last said, at once when the data port is busy, NOT_SERVING when it stops answering."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.config import ServerConfig
from rlep.common.grpc_server import build_server
from rlep.common.health_port import HealthPort, private_socket
from tests.silent_stream import Silent

pytestmark = pytest.mark.integration

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def check(port: int, service: str = "", timeout: float = 2.0) -> int:
    """One health check on a new plaintext connection, as the kubelet makes it: the status it answered."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout).status


def wait_status(port: int, status: int, within_s: float) -> float:
    """Seconds until the health port answers `status`, polled every 0.05 s; fails after `within_s`."""
    started = time.monotonic()
    while (answered := check(port)) != status:
        assert time.monotonic() - started < within_s, f"still {answered} after {within_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_service_health_port_reports_the_data_ports_status(redis_url):
    """A real replay with `health_port=0`: SERVING there for "" and the service's name; a status the service sets
    reaches it within the watcher's period; stopping the service turns it NOT_SERVING before it closes."""
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.replay.main import start_replay
    from rlep.services.replay.server import SERVICE

    running = start_replay(ReplayConfig(server=ServerConfig(port=0, health_port=0), redis_url=redis_url))
    try:
        assert running.health_port not in (None, 0, running.port)
        assert f"health_port={running.health_port}" in running.side_ports
        assert check(running.health_port) == SERVING
        assert check(running.health_port, SERVICE.full_name) == SERVING
        running.health.set("", NOT_SERVING)  # what the rollout's engine watchdog does when its engine dies
        assert wait_status(running.health_port, NOT_SERVING, within_s=5) < 5
        running.health.set("", SERVING)
        wait_status(running.health_port, SERVING, within_s=5)
    finally:
        running.health_port_server.enter_graceful_shutdown()
        assert check(running.health_port) == NOT_SERVING
        running.stop()
    with pytest.raises(grpc.RpcError) as err:
        check(running.health_port, timeout=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # closed with the service


class Wedge(grpc.ServerInterceptor):
    """Blocks gRPC's one polling thread (interceptors run there) while a call to /wedge/Now is being routed, until
    `release` is set: a data server that accepts connections and answers nothing, health checks included."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method == "/wedge/Now":
            self.entered.set()
            self.release.wait(timeout=60)
        return continuation(handler_call_details)


def test_the_health_port_answers_while_the_data_port_is_wedged_then_says_not_serving(caplog):
    wedge = Wedge()
    local = private_socket()
    server, port, _ = build_server(ServerConfig(port=0), lambda _: None, [], [wedge], local_target=local)
    side = HealthPort("127.0.0.1", 0, local, [""], stall_s=1.0)
    data = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert side.wait_first_check(timeout_s=5) and check(side.port) == SERVING
        wedged = data.unary_unary("/wedge/Now").future(b"", timeout=30)
        assert wedge.entered.wait(timeout=10)
        with pytest.raises(grpc.RpcError) as err:  # the data port's own health check waits behind the wedge
            check(port, timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlep.common.health_port"):
            assert check(side.port, timeout=0.5) == SERVING  # answered at once, still within health_stall_s
            wait_status(side.port, NOT_SERVING, within_s=10)
            assert time.monotonic() - started < 10
            assert "has not answered" in caplog.text
            wedge.release.set()
            wait_status(side.port, SERVING, within_s=10)
            assert "answers again" in caplog.text
        with pytest.raises(grpc.RpcError):
            wedged.result()  # /wedge/Now has no handler: UNIMPLEMENTED once routed
    finally:
        wedge.release.set()
        data.close()
        side.stop()
        server.stop(0).wait()


def test_hostile_callers_of_the_health_port_cost_it_nothing():
    """32 checks whose request never comes hold no thread: a probe beside them answers at once; `Watch` (a stream per
    watcher) is refused, an oversized name refused before parsing, an unknown name NOT_FOUND."""
    local = private_socket()
    server, _, _ = build_server(ServerConfig(port=0), lambda _: None, [], local_target=local)
    side = HealthPort("127.0.0.1", 0, local, [""], stall_s=30.0)
    release = threading.Event()
    channels = [grpc.insecure_channel(f"127.0.0.1:{side.port}") for _ in range(32)]
    try:
        assert side.wait_first_check(timeout_s=5)
        silent = [c.stream_unary("/grpc.health.v1.Health/Check").future(Silent(release), timeout=60) for c in channels]
        assert check(side.port, timeout=1.0) == SERVING
        assert not any(call.done() for call in silent)  # all still open: the probe did not wait for them
        stub = health_pb2_grpc.HealthStub(channels[0])
        for request, code in [
            (lambda: list(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)), grpc.StatusCode.UNIMPLEMENTED),
            (lambda: stub.Check(health_pb2.HealthCheckRequest(service="x" * 2048), timeout=5), "RESOURCE_EXHAUSTED"),
            (lambda: stub.Check(health_pb2.HealthCheckRequest(service="no.such"), timeout=5), "NOT_FOUND"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                request()
            assert err.value.code().name == getattr(code, "name", code)
    finally:
        release.set()
        for channel in channels:
            channel.close()
        side.stop()
        server.stop(0).wait()
