"""Waiting until a gRPC server's standard health check says SERVING (operators' scripts, benchmarks, tests)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.grpc_channel import make_channel

HEALTH_CALL_TIMEOUT_S = 2.0  # one Check; a server still loading answers UNAVAILABLE at once
HEALTH_POLL_S = 0.2


def is_serving(address: str, timeout_s: float = 5.0, tls_ca_file: Path | None = None) -> bool:
    """Whether the server at `address` answers its health check with SERVING now (health checks need no token;
    TLS with `tls_ca_file`, or when RLEP_TLS_CA_FILE is set, like every client)."""
    with make_channel(address, tls_ca_file=tls_ca_file) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(
    address: str, timeout_s: float, tls_ca_file: Path | None = None, process: subprocess.Popen | None = None
) -> None:
    """Returns once the server at `address` (host:port) answers SERVING; re-raises its last error after `timeout_s`.

    With `process` (the server's own), a process that ends first fails the wait at once (RuntimeError naming its
    exit status), rather than after `timeout_s` of polling a port nobody will open."""
    channel = make_channel(address, tls_ca_file=tls_ca_file)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_CALL_TIMEOUT_S)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f} s")
            if process is None:
                time.sleep(HEALTH_POLL_S)
                continue
            try:
                code = process.wait(timeout=HEALTH_POLL_S)  # returns the moment it ends
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"the server for {address} (pid {process.pid}) exited with status {code} before serving")
    finally:
        channel.close()
