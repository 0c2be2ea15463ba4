"""The sandbox as a service (`rlep serve sandbox`, issue 50 part 2): a real gRPC server on loopback over the real
sandbox (bubblewrap), with the conventions of the other services: a bearer token, bounded calls, the health check
answered while every slot is busy, /metrics.

Callers that hold slots: a call whose caller never gets a slot ends at its deadline with nothing run; one call more
than `max_calls_in_flight` gets UNAVAILABLE at once; code the sandbox refuses is INVALID_ARGUMENT.
"""

from __future__ import annotations

import shutil
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlep.services.sandbox.client import SandboxClient
from rlep.services.sandbox.config import SandboxConfig, SandboxServiceConfig
from rlep.services.sandbox.main import start_sandbox
from tests.metrics_util import scrape, series_value

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="no `bwrap`: apt-get install bubblewrap to run these"),
]

SLOW = "import time; time.sleep(4); print('slept')"  # holds its slot ~4 s, using no CPU


@pytest.fixture(scope="module")
def service(auth_token_file):
    config = SandboxServiceConfig(
        server=ServerConfig(port=0, metrics_port=0, auth_token_file=auth_token_file, grpc_threads=5),
        sandbox=SandboxConfig(concurrency=1, per_caller=1, wall_seconds=20.0, cache_entries=16, max_code_bytes=4096),
        max_wait_s=30.0,
    )  # 3 calls in flight at most, one running: the rest wait
    running = start_sandbox(config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(service, auth_token_file):
    with SandboxClient(f"127.0.0.1:{service.port}", token=auth_token_file.read_text().strip()) as client:
        yield client


def test_a_call_runs_in_the_sandbox_and_says_what_happened(client):
    result = client.run("import os; print(6 * 7, os.getuid() != 0)", caller="run-a")
    assert (result.status, result.stdout, result.exit_code, result.isolation) == ("ok", "42 True\n", 0, "bubblewrap")
    failed = client.run("raise SystemExit(3)", caller="run-a")  # a failing program is a result, not an RPC error
    assert (failed.status, failed.exit_code) == ("error", 3)
    again = client.run("import os; print(6 * 7, os.getuid() != 0)", caller="run-a")
    assert again.cached and again.stdout == result.stdout


def test_the_service_says_what_its_outputs_depend_on(client, service):
    """What a learner checks against its own tools.sandbox before it trains (launch.stack.check_same_sandbox)."""
    described = client.describe()
    assert described == service.sandbox.config.environment() and described["cpu_seconds"] == 5
    assert "concurrency" not in described and described["python"].startswith("/")


def test_bad_requests_get_invalid_argument_and_run_nothing(client, service):
    with pytest.raises(ValueError, match="max_code_bytes"):
        client.run("x = 1\n" * 1000)  # 6,000 bytes over 4,096
    stub = sandbox_pb2_grpc.SandboxStub(make_channel(f"127.0.0.1:{service.port}", "s3cret-token"))
    for request in (sandbox_pb2.RunRequest(code="print(1)", caller="a b"), sandbox_pb2.RunRequest(code="\0")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Run(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_wrong_token_is_unauthenticated(service):
    stub = sandbox_pb2_grpc.SandboxStub(make_channel(f"127.0.0.1:{service.port}", "wrong"))
    with pytest.raises(grpc.RpcError) as err:
        stub.Run(sandbox_pb2.RunRequest(code="print(1)"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_busy_slots_bound_every_call_and_leave_the_health_check_its_thread(client, service, auth_token_file):
    """One slot: a slow call holds it. A second caller's call with a 1-s deadline ends at it (the client answers
    `sandbox_failure`, nothing ran); calls past max_calls_in_flight get UNAVAILABLE at once; the health check
    answers throughout; the slow call's result comes back whole."""
    token = auth_token_file.read_text().strip()
    ran_before = series_value(scrape(service.metrics_port, token), 'rlep_sandbox_calls_total{status="ok"}')
    slow: dict = {}
    holder = threading.Thread(target=lambda: slow.update(result=client.run(SLOW, caller="slow")))
    holder.start()
    waiting = threading.Event()
    deadline_for = SandboxClient(f"127.0.0.1:{service.port}", token="s3cret-token", timeout_s=1.0)
    try:
        while not service.sandbox.running():  # the slow call has its slot
            time.sleep(0.01)
        started = time.monotonic()
        missed = deadline_for.run("print('never')", caller="impatient")
        waited = time.monotonic() - started
        assert missed.status == "sandbox_failure" and "no slot" in missed.detail and 0.9 < waited < 3.0
        while in_flight(service, token) > 1:  # the server lets the impatient call go as its deadline passes
            time.sleep(0.01)

        stub = sandbox_pb2_grpc.SandboxStub(make_channel(f"127.0.0.1:{service.port}", "s3cret-token"))
        queued = [
            stub.Run.future(sandbox_pb2.RunRequest(code=f"print({i})", caller=f"c{i}"), timeout=30) for i in (1, 2)
        ]
        while sum(service.sandbox.waiting().values()) < 2:  # both wait for the slot: 3 calls in the server
            time.sleep(0.01)
        waiting.set()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Run(sandbox_pb2.RunRequest(code="print(3)", caller="c3"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 1.0
        health = health_pb2_grpc.HealthStub(make_channel(f"127.0.0.1:{service.port}", "s3cret-token"))
        started = time.monotonic()
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started < 1.0
        assert sorted(f.result().stdout for f in queued) == ["1\n", "2\n"]  # they ran once the slot was free
    finally:
        holder.join(timeout=60)
        deadline_for.close()
    assert waiting.is_set() and (slow["result"].status, slow["result"].stdout) == ("ok", "slept\n")
    text = scrape(service.metrics_port, token)
    assert series_value(text, 'rlep_sandbox_requests_total{code="UNAVAILABLE"}') == 1
    # The slow call and the two queued ran; the impatient caller's code never did, nor waits or runs still.
    assert not service.sandbox.waiting() and not service.sandbox.running()
    ran = series_value(scrape(service.metrics_port, token), 'rlep_sandbox_calls_total{status="ok"}')
    assert ran - ran_before == 3


def in_flight(service, token: str) -> float:
    return series_value(scrape(service.metrics_port, token), "rlep_sandbox_calls_in_flight")
