"""The chart's start gate (deploy/helm/rlep/files/wait_rollout.py) against real gRPC rollout replicas.

Two replicas serve GetStatus behind RLEP's bearer token on two loopback IPs sharing one port, as two worker pods
behind the headless Service would; only the resolver stands in for the cluster's DNS (as in
tests/unit/test_rollout_discovery.py). The script runs once as the init container runs it, on `localhost`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest

from rlep.common.grpc_interceptors import BearerAuthInterceptor
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tests.conftest import free_port
from tests.unit.test_helm_chart import CHART, load_wait_rollout
from tests.unit.test_rollout_discovery import POD_IPS, FakeDns

TOKEN = "s3cret-token"
SCRIPT = CHART / "files" / "wait_rollout.py"


class FakeReplica(rollout_pb2_grpc.RolloutServicer):
    """A replica's GetStatus over real gRPC; `failure` set: its engine died (the server answers UNAVAILABLE)."""

    def __init__(self):
        self.failure: str | None = None
        self.calls = 0

    def GetStatus(self, request, context):  # noqa: N802 - the service's method name
        self.calls += 1
        if self.failure is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)
        return rollout_pb2.RolloutStatus(policy_version=0, max_model_len=64)


def serve(address: str, replica: FakeReplica, token: str = TOKEN) -> grpc.Server:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        interceptors=[BearerAuthInterceptor(token)],
        options=[("grpc.so_reuseport", 0)],
    )
    rollout_pb2_grpc.add_RolloutServicer_to_server(replica, server)
    server.add_insecure_port(address)
    server.start()
    return server


def test_gate_waits_for_enough_answering_replicas_and_gives_up_at_its_bound(capsys):
    """Worker pods join the replicas' Service once Ray runs in them, before their replica has loaded the model:
    the gate must wait for `--expect` addresses that also answer, and give up at the bound."""
    gate = load_wait_rollout()
    service = "rlep-rollout-replicas:50063"
    now = [0.0]
    # What each look sees: (pod IPs in DNS, IPs whose replica answers).
    looks = iter(
        [
            ([], []),  # no Ready worker pod yet: NXDOMAIN
            (["10.0.0.1"], ["10.0.0.1"]),  # one pod of two, its replica answering
            (["10.0.0.1", "10.0.0.2"], ["10.0.0.1"]),  # both pods, one replica still loading
            (["10.0.0.2", "10.0.0.1"], ["10.0.0.1", "10.0.0.2"]),
        ]
    )
    answering: list[str] = []

    def resolve(host, port, type=0):  # noqa: A002 - getaddrinfo's parameter name
        assert (host, port) == ("rlep-rollout-replicas", 50063)
        ips, up = next(looks)
        answering[:] = [f"{ip}:{port}" for ip in up]
        if not ips:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]

    def check(addresses):
        return [a for a in addresses if a in answering]

    def sleep(seconds):
        now[0] += seconds

    found = gate.wait_for_replicas(service, 2, 1800.0, check, resolve, sleep, clock=lambda: now[0])
    assert found == ["10.0.0.1:50063", "10.0.0.2:50063"] and now[0] == 3 * gate.RETRY_INTERVAL_S
    progress = capsys.readouterr().out.splitlines()
    assert len(progress) == 3 and all(
        line.startswith(f"waiting for 2 rollout replicas at {service}:") for line in progress
    )
    assert "no address" in progress[0] and "not answering ['10.0.0.2:50063']" in progress[2]

    # A replica that never answers: it gives up at the bound, naming what it saw last.
    looks = iter(lambda: (["10.0.0.1", "10.0.0.2"], ["10.0.0.1"]), None)
    now[0] = 0.0
    with pytest.raises(SystemExit, match=r"within 60 s: 2 resolve, 1 answer .*not answering \['10.0.0.2:50063'\]"):
        gate.wait_for_replicas(service, 2, 60.0, check, resolve, sleep, clock=lambda: now[0])
    assert 60.0 <= now[0] < 60.0 + 2 * gate.RETRY_INTERVAL_S


@pytest.fixture
def servers():
    started: list[grpc.Server] = []
    yield started
    for server in started:
        server.stop(0)


def test_gate_counts_only_pods_whose_replica_answers_with_the_token(servers):
    gate = load_wait_rollout()
    port = free_port()
    first, second = FakeReplica(), FakeReplica()
    servers.append(serve(f"{POD_IPS[0]}:{port}", first))
    dns = FakeDns(POD_IPS[0])

    # Between looks the cluster moves on: the second pod joins DNS before its server listens, then serves with
    # a dead engine, then recovers.
    def joins():
        dns.ips.append(POD_IPS[1])

    def starts_broken():
        second.failure = "engine died"
        servers.append(serve(f"{POD_IPS[1]}:{port}", second))
        # gRPC waits up to 1 s (its first reconnect backoff) before dialling again an address that refused; the
        # gate's 5 s between looks cover it. Here: the gate's own check, repeated until it reaches the new server,
        # then only the gate's next look is counted.
        deadline = time.monotonic() + 30.0
        while second.calls == 0:
            assert time.monotonic() < deadline, "the second server never answered a check"
            gate.check_replicas([f"{POD_IPS[1]}:{port}"], TOKEN)
            time.sleep(0.05)
        second.calls = 0

    def recovers():
        assert second.calls == 1, "the look after the second server started did not reach it"
        second.failure = None

    steps = iter([joins, starts_broken, recovers])
    answering = gate.wait_for_replicas(
        f"rlep-rollout-replicas:{port}",
        expect=2,
        wait_s=120.0,
        check=lambda addresses: gate.check_replicas(addresses, TOKEN),
        resolve=dns,
        sleep=lambda _: next(steps)(),
    )
    assert answering == [f"{ip}:{port}" for ip in POD_IPS]
    assert next(steps, None) is None, "the gate passed before the second replica answered"


def test_gate_run_as_the_init_container_passes_fails_at_its_bound_and_on_a_wrong_token(servers, tmp_path):
    gate = load_wait_rollout()
    port = free_port()
    servers.append(serve(f"localhost:{port}", FakeReplica()))
    token_file, wrong_file = tmp_path / "auth-token", tmp_path / "wrong"
    token_file.write_text(TOKEN + "\n")
    wrong_file.write_text("not-the-token\n")
    service = f"--service=localhost:{port}"

    passed = subprocess.run(
        [sys.executable, str(SCRIPT), service, "--expect=1", "--wait-s=60", f"--token-file={token_file}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert passed.returncode == 0, passed.stderr[-3000:]
    assert f"rollout replicas answer at localhost:{port}: ['127.0.0.1:{port}'" in passed.stdout

    with pytest.raises(
        SystemExit, match=rf"5 rollout replicas at localhost:{port} did not answer within 0 s: .*answer"
    ):
        gate.main([service, "--expect=5", "--wait-s=0", f"--token-file={token_file}"])
    with pytest.raises(SystemExit, match="refused the check: UNAUTHENTICATED"):
        gate.main([service, "--expect=1", "--wait-s=60", f"--token-file={wrong_file}"])
