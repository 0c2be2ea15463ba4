"""`rlep serve <service>` as an operator runs it: a separate process, health, one call, clean shutdown, no secret
in what it prints."""

from __future__ import annotations

import httpx
import pytest

from rlep.common.types import Verdict
from rlep.services.verifier.client import VerifierClient
from tests.conftest import free_port
from tests.service_process import ROLLOUT_STARTUP_TIMEOUT_S, start_service

pytestmark = pytest.mark.integration

LEAK_CANARY = "t0ken-that-must-not-leak"  # the token services are started with; must appear nowhere they print


def test_serve_verifier_process(tmp_path):
    """Serves on the port it picked; SIGUSR1 writes every thread's stack and it goes on serving (how an operator
    sees where a stuck service waits, and what a test prints when a start times out); SIGTERM stops it cleanly."""
    verifier = start_service("verifier", tmp_path / "verifier.out", sets=["num_workers=1"])
    try:
        assert verifier.dump_stacks(), "SIGUSR1 wrote no stacks"
        assert "in serve_forever" in verifier.output()  # the main thread, waiting for its stop signal
        with VerifierClient(verifier.address) as client:
            [outcome] = client.verify([("\\boxed{\\frac{6}{8}}", "0.75")])
        assert outcome.verdict == Verdict.CORRECT
    finally:
        output = verifier.stop(timeout_s=30)
    assert verifier.returncode == 0, output
    assert f"verifier listening on {verifier.address}" in output


def test_serve_verifier_over_tls(tmp_path, monkeypatch):
    """TLS from the config, end to end: `rlep serve` with a certificate answers TLS clients on both ports."""
    import ssl
    import urllib.request

    from rlep.common.tls import CA_FILE_ENV
    from tests.integration.test_tls import self_signed

    cert_file, key_file = self_signed(tmp_path)
    metrics_port = free_port()
    sets = ["num_workers=1", f"server.tls_cert_file={cert_file}", f"server.tls_key_file={key_file}"]
    args = ["--metrics-port", str(metrics_port)]
    verifier = start_service("verifier", tmp_path / "verifier.out", args, sets, tls_ca_file=cert_file)
    try:
        monkeypatch.setenv(CA_FILE_ENV, str(cert_file))  # how every client (here VerifierClient) is told
        with VerifierClient(f"localhost:{verifier.port}") as client:
            [outcome] = client.verify([("\\boxed{2}", "2")])
        assert outcome.verdict == Verdict.CORRECT
        context = ssl.create_default_context(cafile=str(cert_file))
        with urllib.request.urlopen(f"https://localhost:{metrics_port}/metrics", context=context, timeout=10) as r:
            assert b"rlep_verifier_items_total" in r.read()
    finally:
        output = verifier.stop(timeout_s=30)
    assert verifier.returncode == 0, output


@pytest.mark.slow
def test_serve_rollout_process_standalone(tmp_path):
    """`rlep serve rollout` without Ray (how Kubernetes runs it), with a token: serves, then stops cleanly on SIGTERM,
    and its token appears nowhere in what it printed."""
    from rlep.services.rollout.client import RolloutClient
    from rlep.services.rollout.types import Sampling

    token_file = tmp_path / "token"
    token_file.write_text(f"{LEAK_CANARY}\n")
    sets = ["engine.model=tiny", "engine.enforce_eager=true", "engine.max_model_len=256"]
    args = ["--auth-token-file", str(token_file)]
    worker = start_service("rollout", tmp_path / "rollout.out", args, sets, timeout_s=ROLLOUT_STARTUP_TIMEOUT_S)
    try:
        client = RolloutClient([worker.address], token=LEAK_CANARY)
        [completion] = client.generate(["Q: 2+2=?\nA: "], Sampling(n=2, max_tokens=4))
        client.close()
        assert len(completion.samples) == 2 and all(s.token_ids for s in completion.samples)
    finally:
        output = worker.stop(timeout_s=60)
    assert worker.returncode == 0, output[-3000:]
    assert f"rollout listening on {worker.address}" in output
    assert LEAK_CANARY not in output, "rlep serve rollout printed its token"


@pytest.mark.parametrize("service", ["replay", "verifier", "eval"])
def test_a_service_never_prints_its_token_or_its_redis_password(tmp_path, service):
    """Issue 31: replay's start-up line printed its embedded Redis's password. Started with a token, called with the
    right and a wrong one, stopped: neither secret appears anywhere in what the process wrote. (Rollout: its
    standalone test above.)"""
    token_file = tmp_path / "token"
    token_file.write_text(f"{LEAK_CANARY}\n")
    embedded_redis = service in ("replay", "eval")
    sets = ["local_redis_dir=" + str(tmp_path / "redis")] if embedded_redis else ["num_workers=1"]
    started = start_service(service, tmp_path / f"{service}.out", ["--auth-token-file", str(token_file)], sets)
    try:
        for token in (LEAK_CANARY, "wrong-token"):
            if service == "eval":
                httpx.get(f"{started.url}/v1/evaluations", headers={"Authorization": f"Bearer {token}"})
            else:
                method = "/rlep.replay.v1.ReplayBuffer/ListPools" if service == "replay" else None
                call_with_token(started.address, token, method)
    finally:
        output = started.stop(timeout_s=30)
    assert f"{service} listening" in output, output
    secrets = [LEAK_CANARY]
    if embedded_redis:
        secrets.append((tmp_path / "redis" / "redis.password").read_text().strip())
        assert "redis=redis://" in output, output  # where its Redis is, without the password
    for secret in secrets:
        assert secret not in output, f"a secret appears in the output of rlep serve {service}"


def call_with_token(address: str, token: str, method: str | None) -> None:
    """A health check, and `method` (no body) when given, with `token`; refusals are what a wrong token gets."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rlep.common.grpc_channel import make_channel

    channel = make_channel(address, token)
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        if method:
            channel.unary_unary(method)(b"", timeout=5)
    except grpc.RpcError:
        pass


def test_a_service_that_cannot_start_fails_its_wait_at_once_with_why(tmp_path):
    """Tests wait on a process, not on a port: a start that fails (here a config refused) fails the wait as it
    happens, with the process's own words, instead of after the timeout (far above pytest's 600 s here)."""
    with pytest.raises(AssertionError, match=r"exited with status 2 before it served[\s\S]*invalid `num_workers`"):
        start_service("verifier", tmp_path / "verifier.out", sets=["num_workers=0"], timeout_s=3600)
