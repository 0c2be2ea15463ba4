"""`rlep serve replay` and `rlep serve eval` on their embedded Redis when that Redis dies: restarted on the same port,
data and password within seconds (no acknowledged write lost), or, when it cannot be, NOT_SERVING (eval: /healthz
503) and an exit for the process's supervisor. Before (issue 31): 60 s after the kill, 120/120 replay adds
UNAVAILABLE and the health check SERVING; eval had no Redis of its own (it wrote into whatever answered on 6379)."""

from __future__ import annotations

import time

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.grpc_channel import make_channel
from rlep.services.eval.main import EMBEDDED_REDIS_LOST_EXIT_CODE as EVAL_LOST_EXIT_CODE
from rlep.services.replay.client import ReplayClient
from rlep.services.replay.main import EMBEDDED_REDIS_LOST_EXIT_CODE
from tests.health_util import statuses_until_not_serving
from tests.service_process import ServiceProcess, start_service

pytestmark = pytest.mark.integration
RECOVERY_BOUND_S = 10.0


def successes(start: int, count: int) -> list:
    from tests.integration.test_replay_service import success

    return [success("q", i) for i in range(start, start + count)]


def start_replay(data_dir) -> ServiceProcess:
    return start_service("replay", data_dir.parent / f"{data_dir.name}.out", sets=[f"local_redis_dir={data_dir}"])


def start_eval(data_dir) -> ServiceProcess:
    """`rlep serve eval` with no redis_url: its own redis-server under `data_dir`."""
    return start_service("eval", data_dir.parent / f"{data_dir.name}.out", sets=[f"local_redis_dir={data_dir}"])


def kill_redis(service: ServiceProcess) -> int:
    [server] = [p for p in psutil.Process(service.pid).children() if "redis-server" in p.name()]
    server.kill()  # SIGKILL: gone at once (reaping it is its parent's business)
    return server.pid


def test_a_killed_embedded_redis_is_restarted_and_loses_no_acknowledged_add(tmp_path):
    service = start_replay(tmp_path / "redis")
    try:
        with ReplayClient(service.address, timeout_s=5) as client:
            assert client.add("p", successes(0, 5)).added == 5
            old_pid = kill_redis(service)
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
        [server] = [p for p in psutil.Process(service.pid).children() if "redis-server" in p.name()]
        assert server.pid != old_pid
        health = health_pb2_grpc.HealthStub(make_channel(service.address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        output = service.stop(timeout_s=30)
    print(f"embedded Redis killed: adds land again after {recovered_s:.2f} s")
    assert service.returncode == 0 and "embedded redis-server restarted on port" in output, output


def test_an_embedded_redis_that_cannot_restart_turns_replay_not_serving_and_ends_it(tmp_path):
    data_dir = tmp_path / "redis"
    service = start_replay(data_dir)
    try:
        watch = health_pb2_grpc.HealthStub(make_channel(service.address)).Watch(
            health_pb2.HealthCheckRequest(), timeout=60
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        [manifest] = (data_dir / "appendonlydir").glob("*.manifest")
        manifest.write_text("not a manifest\n")  # what a damaged disk leaves: redis-server refuses to start on it
        kill_redis(service)
        statuses = statuses_until_not_serving(watch)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        service.wait(timeout_s=60)
    finally:
        service.kill()
        output = service.output()
    assert service.returncode == EMBEDDED_REDIS_LOST_EXIT_CODE, output
    assert "could not be restarted (3 tries)" in output, output


def test_eval_starts_its_own_password_protected_redis_and_keeps_jobs_across_its_restart(tmp_path):
    import redis

    data_dir = tmp_path / "eval-redis"
    service = start_eval(data_dir)
    try:
        [server] = [p for p in psutil.Process(service.pid).children() if "redis-server" in p.name()]
        port = next(c.laddr.port for c in server.net_connections() if c.status == psutil.CONN_LISTEN)
        with pytest.raises(redis.AuthenticationError):  # never an open Redis another program could write into
            redis.Redis(port=port).set("k", "v")
        submitted = httpx.post(
            f"{service.url}/v1/evaluations",
            json={"model": "current", "datasets": [{"name": "amc23", "limit": 1}]},
            timeout=10,
        )
        assert submitted.status_code == 202, submitted.text
        job = submitted.json()["id"]
        kill_redis(service)
        killed = time.monotonic()
        while (reply := httpx.get(f"{service.url}/v1/evaluations/{job}", timeout=10)).status_code != 200:
            assert reply.status_code == 503, reply.text  # "job store unavailable" until the restart
            assert time.monotonic() - killed < RECOVERY_BOUND_S, "eval's embedded Redis was not restarted"
        assert reply.json()["id"] == job  # the job written before the kill survived it (AOF, fsync always)
        assert httpx.get(f"{service.url}/healthz").status_code == 200
    finally:
        output = service.stop(timeout_s=30)
    assert service.returncode == 0 and "embedded redis-server restarted on port" in output, output


def test_an_embedded_redis_that_cannot_restart_fails_evals_health_and_ends_it(tmp_path):
    data_dir = tmp_path / "eval-redis"
    service = start_eval(data_dir)
    try:
        [manifest] = (data_dir / "appendonlydir").glob("*.manifest")
        manifest.write_text("not a manifest\n")
        kill_redis(service)
        service.wait(timeout_s=60)
    finally:
        service.kill()
        output = service.output()
    assert service.returncode == EVAL_LOST_EXIT_CODE, output
    assert "could not be restarted (3 tries)" in output, output


def test_evals_health_turns_503_when_its_redis_is_lost_for_good(tmp_path):
    """In process, so the moment is a hook (on_failure), not a race with the exit."""
    import threading

    from rlep.services.eval.config import EvalConfig
    from rlep.services.eval.main import start_eval as start_eval_service

    lost = threading.Event()
    data_dir = tmp_path / "eval-redis"
    running = start_eval_service(
        EvalConfig.model_validate({"server": {"port": 0}, "local_redis_dir": str(data_dir)}),
        on_failure=lambda _: lost.set(),
    )
    try:
        assert httpx.get(f"{running.url}/healthz").status_code == 200
        [manifest] = (data_dir / "appendonlydir").glob("*.manifest")
        manifest.write_text("not a manifest\n")
        running.redis_supervisor.server.kill()
        assert lost.wait(60), "the supervisor never gave up"
        reply = httpx.get(f"{running.url}/healthz")
        assert reply.status_code == 503 and "could not be restarted" in reply.json()["detail"], reply.text
    finally:
        running.stop()
