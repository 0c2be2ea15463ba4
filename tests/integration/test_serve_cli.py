"""`rlep serve verifier` as an operator runs it: a separate process, health, one call, clean shutdown."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rlep.common import health
from rlep.common.types import Verdict
from rlep.services.verifier.client import VerifierClient
from tests.conftest import free_port

pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 60.0
LEAK_CANARY = "t0ken-that-must-not-leak"  # the token services are started with; must appear nowhere they print


def rlep_command() -> list[str]:
    script = Path(sys.executable).with_name("rlep")
    return [str(script)] if script.exists() else [shutil.which("rlep") or "rlep"]


def wait_serving(port: int, timeout_s: float = STARTUP_TIMEOUT_S, tls_ca_file: Path | None = None) -> None:
    health.wait_serving(f"127.0.0.1:{port}", timeout_s, tls_ca_file)


def test_serve_verifier_process(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [*rlep_command(), "serve", "verifier", "--port", str(port), "--set", "num_workers=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_serving(port)
        with VerifierClient(f"127.0.0.1:{port}") as client:
            [outcome] = client.verify([("\\boxed{\\frac{6}{8}}", "0.75")])
        assert outcome.verdict == Verdict.CORRECT
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"verifier listening on 127.0.0.1:{port}" in output


def test_serve_verifier_over_tls(tmp_path, monkeypatch):
    """TLS from the config, end to end: `rlep serve` with a certificate answers TLS clients on both ports."""
    import ssl
    import urllib.request

    from rlep.common.tls import CA_FILE_ENV
    from tests.integration.test_tls import self_signed

    cert_file, key_file = self_signed(tmp_path)
    port, metrics_port = free_port(), free_port()
    sets = ["num_workers=1", f"server.tls_cert_file={cert_file}", f"server.tls_key_file={key_file}"]
    command = [*rlep_command(), "serve", "verifier", "--port", str(port), "--metrics-port", str(metrics_port)]
    command += [a for s in sets for a in ("--set", s)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(port, tls_ca_file=cert_file)
        monkeypatch.setenv(CA_FILE_ENV, str(cert_file))  # how every client (here VerifierClient) is told
        with VerifierClient(f"localhost:{port}") as client:
            [outcome] = client.verify([("\\boxed{2}", "2")])
        assert outcome.verdict == Verdict.CORRECT
        context = ssl.create_default_context(cafile=str(cert_file))
        with urllib.request.urlopen(f"https://localhost:{metrics_port}/metrics", context=context, timeout=10) as r:
            assert b"rlep_verifier_items_total" in r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output


@pytest.mark.slow
def test_serve_rollout_process_standalone(tmp_path):
    """`rlep serve rollout` without Ray (how Kubernetes runs it), with a token: serves, then stops cleanly on SIGTERM,
    and its token appears nowhere in what it printed."""
    from rlep.services.rollout.client import RolloutClient
    from rlep.services.rollout.types import Sampling

    token_file = tmp_path / "token"
    token_file.write_text(f"{LEAK_CANARY}\n")
    port = free_port()
    sets = ["engine.model=tiny", "engine.enforce_eager=true", "engine.max_model_len=256"]
    proc = subprocess.Popen(
        [
            *rlep_command(),
            "serve",
            "rollout",
            "--port",
            str(port),
            "--auth-token-file",
            str(token_file),
            *[a for s in sets for a in ("--set", s)],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_serving(port, timeout_s=300)
        client = RolloutClient([f"127.0.0.1:{port}"], token=LEAK_CANARY)
        [completion] = client.generate(["Q: 2+2=?\nA: "], Sampling(n=2, max_tokens=4))
        client.close()
        assert len(completion.samples) == 2 and all(s.token_ids for s in completion.samples)
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output[-3000:]
    assert f"rollout listening on 127.0.0.1:{port}" in output
    assert LEAK_CANARY not in output, "rlep serve rollout printed its token"


@pytest.mark.parametrize("service", ["replay", "verifier", "eval"])
def test_a_service_never_prints_its_token_or_its_redis_password(tmp_path, service):
    """Issue 31: replay's start-up line printed its embedded Redis's password. Started with a token, called with the
    right and a wrong one, stopped: neither secret appears anywhere in what the process wrote. (Rollout: its
    standalone test above.)"""
    token_file = tmp_path / "token"
    token_file.write_text(f"{LEAK_CANARY}\n")
    port = free_port()
    embedded_redis = service in ("replay", "eval")
    sets = ["local_redis_dir=" + str(tmp_path / "redis")] if embedded_redis else ["num_workers=1"]
    proc = subprocess.Popen(
        [
            *rlep_command(),
            "serve",
            service,
            "--port",
            str(port),
            "--auth-token-file",
            str(token_file),
            *[a for s in sets for a in ("--set", s)],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if service == "eval":
            wait_http_ok(f"http://127.0.0.1:{port}/healthz")
            for token in (LEAK_CANARY, "wrong-token"):
                httpx.get(f"http://127.0.0.1:{port}/v1/evaluations", headers={"Authorization": f"Bearer {token}"})
        else:
            wait_serving(port)
            for token in (LEAK_CANARY, "wrong-token"):
                call_with_token(port, token, "/rlep.replay.v1.ReplayBuffer/ListPools" if service == "replay" else None)
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert f"{service} listening" in output, output
    secrets = [LEAK_CANARY]
    if embedded_redis:
        secrets.append((tmp_path / "redis" / "redis.password").read_text().strip())
        assert "redis=redis://" in output, output  # where its Redis is, without the password
    for secret in secrets:
        assert secret not in output, f"a secret appears in the output of rlep serve {service}"


def call_with_token(port: int, token: str, method: str | None) -> None:
    """A health check, and `method` (no body) when given, with `token`; refusals are what a wrong token gets."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rlep.common.grpc_utils import make_channel

    channel = make_channel(f"127.0.0.1:{port}", token)
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        if method:
            channel.unary_unary(method)(b"", timeout=5)
    except grpc.RpcError:
        pass


def wait_http_ok(url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until `url` answers 200 (a starting HTTP service), polling; fails after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer 200 within {timeout_s} s"
        time.sleep(0.1)
