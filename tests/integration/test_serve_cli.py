"""`rlep serve verifier` as an operator runs it: a separate process, health, one call, clean shutdown."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlep.common import health
from rlep.common.types import Verdict
from rlep.services.verifier.client import VerifierClient
from tests.conftest import free_port

pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 60.0


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
def test_serve_rollout_process_standalone():
    """`rlep serve rollout` without Ray (how Kubernetes runs it): serves, then stops cleanly on SIGTERM."""
    from rlep.services.rollout.client import RolloutClient
    from rlep.services.rollout.types import Sampling

    port = free_port()
    sets = ["engine.model=tiny", "engine.enforce_eager=true", "engine.max_model_len=256"]
    proc = subprocess.Popen(
        [*rlep_command(), "serve", "rollout", "--port", str(port), *[a for s in sets for a in ("--set", s)]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_serving(port, timeout_s=300)
        client = RolloutClient([f"127.0.0.1:{port}"])
        [completion] = client.generate(["Q: 2+2=?\nA: "], Sampling(n=2, max_tokens=4))
        client.close()
        assert len(completion.samples) == 2 and all(s.token_ids for s in completion.samples)
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output[-3000:]
    assert f"rollout listening on 127.0.0.1:{port}" in output


@pytest.mark.parametrize("service", ["replay", "verifier"])
def test_a_service_never_prints_its_token_or_its_redis_password(tmp_path, service):
    """Issue 31: replay's start-up line printed its embedded Redis's password. Started with a token, called with the
    right and a wrong one, stopped: neither secret appears anywhere in what the process wrote."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rlep.common.grpc_utils import make_channel

    token_file = tmp_path / "token"
    token_file.write_text("t0ken-that-must-not-leak\n")
    port = free_port()
    sets = ["local_redis_dir=" + str(tmp_path / "redis")] if service == "replay" else ["num_workers=1"]
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
        wait_serving(port)
        for token in ("t0ken-that-must-not-leak", "wrong-token"):
            channel = make_channel(f"127.0.0.1:{port}", token)
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                method = "/rlep.replay.v1.ReplayBuffer/ListPools" if service == "replay" else None
                if method:
                    channel.unary_unary(method)(b"", timeout=5)
            except grpc.RpcError:
                pass
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    secrets = ["t0ken-that-must-not-leak"]
    if service == "replay":
        secrets.append((tmp_path / "redis" / "redis.password").read_text().strip())
        assert "replay listening" in output
    for secret in secrets:
        assert secret not in output, f"a secret appears in the output of rlep serve {service}"
