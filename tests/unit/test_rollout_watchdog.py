"""The rollout worker's watchdog: a dead engine turns the real gRPC health check NOT_SERVING and releases callers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rlep.services.rollout.main import EngineWatchdog


def test_a_dead_engine_turns_health_not_serving_and_releases_waiting_callers():
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    dead = threading.Event()
    released, failures = [], []
    watchdog = EngineWatchdog(
        failure=lambda: "the vLLM engine core process died" if dead.is_set() else None,
        release=released.append,
        health_servicer=servicer,
        on_failure=failures.append,
        period_s=0.01,
    )
    try:
        check = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING and not watchdog.tripped.is_set()
        dead.set()
        assert watchdog.tripped.wait(timeout=10)
        check = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert released == failures == ["the vLLM engine core process died"]
        # For good: nothing sets it back to SERVING.
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        check = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        watchdog.stop()
        server.stop(0)
