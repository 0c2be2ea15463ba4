"""The shared /metrics + /healthz server under hostile clients, and the one Authorization rule on both transports.

A real replay service (gRPC + /metrics, real Redis) for what a service exposes; a bare `MetricsServer`
with small limits where a limit itself is tested.
"""

from __future__ import annotations

import http.client
import select
import socket
import time
import urllib.request

import grpc
import pytest

from rlep.common.auth import DUPLICATE
from rlep.common.grpc_channel import make_channel
from rlep.common.http_server import HEAD_TIMEOUT_S
from rlep.common.metrics import MetricsServer, service_registry
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc

pytestmark = pytest.mark.integration

# A scrape on loopback answers in milliseconds. The bound must stay under the server's head deadline: a
# single-threaded server would answer only once it dropped the half-sent request, i.e. after HEAD_TIMEOUT_S.
SCRAPE_TIMEOUT_S = 3.0
assert SCRAPE_TIMEOUT_S < HEAD_TIMEOUT_S


def half_sent_request(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /metr")
    return sock


def raw_response(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=SCRAPE_TIMEOUT_S) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def http_get(port: int, path: str, authorization: list[str]) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SCRAPE_TIMEOUT_S)
    conn.putrequest("GET", path)
    for value in authorization:
        conn.putheader("Authorization", value)
    conn.endheaders()
    reply = conn.getresponse()
    status, body = reply.status, reply.read().decode()
    conn.close()
    return status, body


@pytest.fixture
def small_server():
    server = MetricsServer(
        service_registry("test"), "127.0.0.1", 0, head_timeout_s=1.0, max_connections=2, max_head_bytes=1024
    )
    yield server
    server.stop()


def test_a_half_sent_request_does_not_block_scrapes_or_probes(replay):
    """One idle unauthenticated connection used to stall every later scrape of a single-threaded server."""
    slow = half_sent_request(replay.metrics_port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{replay.metrics_port}/healthz", timeout=SCRAPE_TIMEOUT_S) as r:
            assert r.read() == b"ok\n"
        status, body = http_get(replay.metrics_port, "/metrics", ["Bearer s3cret-token"])
        assert status == 200 and "rlep_replay_" in body
    finally:
        slow.close()


def test_a_trickling_client_is_dropped_at_the_head_deadline(small_server):
    """Sending a byte now and then must not keep a connection (and its thread) forever."""
    sock = socket.create_connection(("127.0.0.1", small_server.port))
    sock.sendall(b"GET /metrics HTTP/1.0\r\nX-Slow: ")
    start = time.monotonic()
    closed = False
    try:
        while not closed and time.monotonic() - start < 10:
            readable, _, _ = select.select([sock], [], [], 0.2)  # one byte per 0.2 s, well inside 1 s per read
            if readable:
                closed = sock.recv(1024) == b""
            else:
                sock.send(b"a")
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    finally:
        sock.close()
    elapsed = time.monotonic() - start
    assert closed, "the server kept a trickling connection open for 10 s"
    assert elapsed < 5, f"dropped after {elapsed:.1f} s, head deadline is 1 s"


def test_connections_over_the_cap_get_503_naming_the_limit(small_server):
    idle = [socket.create_connection(("127.0.0.1", small_server.port)) for _ in range(2)]
    try:
        reply = raw_response(small_server.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    finally:
        for sock in idle:
            sock.close()
    assert reply.startswith(b"HTTP/1.0 503")
    assert b"over the limit of 2 concurrent connections" in reply


def test_an_oversized_request_head_gets_431_naming_the_limit(small_server):
    reply = raw_response(small_server.port, b"GET /metrics HTTP/1.0\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
    assert reply.split(b"\r\n", 1)[0].startswith(b"HTTP/1.0 431")
    assert b"over the limit of 1024 bytes" in reply


def test_metrics_accept_any_scheme_case_and_refuse_two_headers(replay):
    assert http_get(replay.metrics_port, "/metrics", ["bearer s3cret-token"])[0] == 200
    status, body = http_get(replay.metrics_port, "/metrics", ["Bearer wrong", "Bearer s3cret-token"])
    assert (status, body.strip()) == (401, DUPLICATE)
    assert http_get(replay.metrics_port, "/metrics", [])[0] == 401


def test_grpc_accepts_any_scheme_case_and_refuses_two_headers(replay):
    stub = replay_pb2_grpc.ReplayBufferStub(make_channel(f"127.0.0.1:{replay.port}"))
    request = replay_pb2.ListPoolsRequest()
    stub.ListPools(request, metadata=[("authorization", "bearer s3cret-token")], timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        two = [("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret-token")]
        stub.ListPools(request, metadata=two, timeout=10)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, DUPLICATE)
