"""The Ray Serve entry points deploy/ray/serve.yaml names and the container health check, each run for real:
verifier and eval as Serve applications on a local Ray (eval finding rollout through the replica registry),
healthcheck.py against live servers. The chart's rollout start gate needs no Ray (its tests:
tests/unit/test_helm_wait_rollout.py)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import REPO_ROOT, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEALTHCHECK = REPO_ROOT / "deploy" / "docker" / "healthcheck.py"
FAKE_ROLLOUT_APP = "rlep-rollout-deploy-test"


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def serve_verifier(ray_local, auth_token_file):
    """rlep.services.verifier.ray_app deployed as `serve deploy` would, with one worker (ray_local has 2 CPUs)."""
    from ray import serve

    from rlep.services.verifier.ray_app import app_builder

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = free_port()
    server = {"host": "127.0.0.1", "port": port, "metrics_port": free_port(), "auth_token_file": str(auth_token_file)}
    serve.run(
        app_builder({"config": {"server": server, "num_workers": 1}}), name="rlep-verifier-test", route_prefix=None
    )
    yield f"127.0.0.1:{port}"
    serve.delete("rlep-verifier-test")


@pytest.fixture(scope="module")
def fake_rollout_registry(ray_local, serve_verifier):
    """A rollout registry holding one live gRPC server (the verifier answers health checks) and one dead address."""
    from rlep.services.rollout.registry import registry

    handle = registry(FAKE_ROLLOUT_APP)
    ray_local.get(handle.register.remote("live", serve_verifier))
    ray_local.get(handle.register.remote("dead", f"127.0.0.1:{free_port()}"))
    yield serve_verifier
    ray_local.kill(handle)


def test_verifier_app_serves_the_grpc_contract_with_its_token(serve_verifier, auth_token_file):
    from rlep.services.verifier.client import VerifierClient

    with VerifierClient(serve_verifier, token=auth_token_file.read_text().strip()) as client:
        [outcome] = client.verify([(r"the answer is \boxed{\frac12}", "0.5")])
    assert outcome.reward == 1.0


def test_container_healthcheck_tells_serving_from_down(serve_verifier, verifier):
    assert healthcheck("grpc", serve_verifier).returncode == 0
    down = healthcheck("grpc", f"127.0.0.1:{free_port()}")
    assert down.returncode == 1 and "not healthy" in down.stderr
    assert healthcheck("http", f"http://127.0.0.1:{verifier.metrics_port}/healthz").returncode == 0
    assert healthcheck("http", f"http://127.0.0.1:{verifier.metrics_port}/nope").returncode == 1
    assert healthcheck("ftp", "x").returncode == 2


def test_eval_app_finds_rollout_through_the_registry_and_serves_http(
    ray_local, fake_rollout_registry, redis_url, auth_token_file
):
    from ray import serve

    from rlep.services.eval.ray_app import app_builder

    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "redis_url": redis_url,
        "key_prefix": "rlep:eval-deploy-test:",
        "verifier": {"address": fake_rollout_registry, "auth_token_file": str(auth_token_file)},
    }
    serve.run(
        app_builder({"config": config, "rollout_app": FAKE_ROLLOUT_APP}), name="rlep-eval-test", route_prefix=None
    )
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
            assert reply.status == 200
        handle = serve.get_app_handle("rlep-eval-test")
        assert handle.get_url.remote().result(timeout_s=30) == f"http://127.0.0.1:{port}"
    finally:
        serve.delete("rlep-eval-test")
