"""`wait_serving`, what scripts and benchmarks wait on: it returns for a server that is SERVING, and, told the server's
process, fails the moment that process ends instead of polling a port nobody will open until its timeout."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rlep.common.health import wait_serving
from rlep.common.ports import free_port


def test_returns_for_a_serving_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        wait_serving(f"127.0.0.1:{port}", timeout_s=30)
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(TimeoutError, match="did not report SERVING"):
            wait_serving(f"127.0.0.1:{port}", timeout_s=1)
    finally:
        server.stop(None)


def test_a_server_process_that_exits_first_fails_the_wait_at_once():
    """The timeout is far above pytest's own: without the process check this test times out rather than pass."""
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    with pytest.raises(RuntimeError, match=f"pid {process.pid}\\) exited with status 7 before serving"):
        wait_serving(f"127.0.0.1:{free_port()}", timeout_s=3600, process=process)
