"""`rlep serve replay` on its embedded Redis when that Redis dies: restarted on the same port, data and password
within seconds (no acknowledged write lost), or, when it cannot be, NOT_SERVING and an exit for the process's
supervisor. Before (issue 31): 60 s after the kill, 120/120 adds UNAVAILABLE and the health check SERVING."""

from __future__ import annotations

import signal
import subprocess
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.grpc_utils import make_channel
from rlep.services.replay.client import ReplayClient
from rlep.services.replay.main import EMBEDDED_REDIS_LOST_EXIT_CODE
from tests.conftest import free_port
from tests.health_util import statuses_until_not_serving
from tests.integration.test_serve_cli import rlep_command, wait_serving

pytestmark = pytest.mark.integration
RECOVERY_BOUND_S = 10.0


def successes(start: int, count: int) -> list:
    from tests.integration.test_replay_service import success

    return [success("q", i) for i in range(start, start + count)]


def start_replay(data_dir) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [*rlep_command(), "serve", "replay", "--port", str(port), "--set", f"local_redis_dir={data_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_serving(port)
    return proc, f"127.0.0.1:{port}"


def kill_redis(proc: subprocess.Popen) -> int:
    [server] = [p for p in psutil.Process(proc.pid).children() if "redis-server" in p.name()]
    server.kill()  # SIGKILL: gone at once (reaping it is its parent's business)
    return server.pid


def test_a_killed_embedded_redis_is_restarted_and_loses_no_acknowledged_add(tmp_path):
    proc, address = start_replay(tmp_path / "redis")
    try:
        with ReplayClient(address, timeout_s=5) as client:
            assert client.add("p", successes(0, 5)).added == 5
            old_pid = kill_redis(proc)
            killed = time.monotonic()
            while True:  # adds are refused (UNAVAILABLE) until the restart; then they land
                try:
                    reply = client.add("p", successes(5, 1))
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    assert time.monotonic() - killed < RECOVERY_BOUND_S, "the embedded Redis was not restarted"
            recovered_s = time.monotonic() - killed
            assert reply.added == 1 and client.stats("p").trajectories == 6  # the 5 acknowledged before survived
        [server] = [p for p in psutil.Process(proc.pid).children() if "redis-server" in p.name()]
        assert server.pid != old_pid
        health = health_pb2_grpc.HealthStub(make_channel(address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    print(f"embedded Redis killed: adds land again after {recovered_s:.2f} s")
    assert proc.returncode == 0 and "embedded redis-server restarted on port" in output, output


def test_an_embedded_redis_that_cannot_restart_turns_replay_not_serving_and_ends_it(tmp_path):
    data_dir = tmp_path / "redis"
    proc, address = start_replay(data_dir)
    try:
        watch = health_pb2_grpc.HealthStub(make_channel(address)).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        [manifest] = (data_dir / "appendonlydir").glob("*.manifest")
        manifest.write_text("not a manifest\n")  # what a damaged disk leaves: redis-server refuses to start on it
        kill_redis(proc)
        statuses = statuses_until_not_serving(watch)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        proc.wait(timeout=60)
    finally:
        proc.kill()
        output = proc.stdout.read()
    assert proc.returncode == EMBEDDED_REDIS_LOST_EXIT_CODE, output
    assert "could not be restarted (3 tries)" in output, output
