"""`rlep serve verifier` as an operator runs it: a separate process, health, one call, clean shutdown."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep_common.grpc_utils import make_channel
from rlep_common.types import Verdict
from services.verifier.client import VerifierClient
from tests.conftest import free_port

pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 60.0


def rlep_command() -> list[str]:
    script = Path(sys.executable).with_name("rlep")
    return [str(script)] if script.exists() else [shutil.which("rlep") or "rlep"]


def wait_serving(port: int) -> None:
    stub = health_pb2_grpc.HealthStub(make_channel(f"127.0.0.1:{port}"))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


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
