"""Real servers on loopback, started once per test session."""

from __future__ import annotations

import pytest

from rlep_common.config import ServerConfig


@pytest.fixture(scope="session")
def auth_token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text("s3cret-token\n")
    return path


@pytest.fixture(scope="session")
def verifier(auth_token_file):
    """A real verifier (2 math-verify worker processes) requiring a bearer token, with /metrics."""
    from services.verifier.config import VerifierConfig
    from services.verifier.main import start_verifier

    config = VerifierConfig(
        server=ServerConfig(port=0, metrics_port=0, auth_token_file=auth_token_file, max_request_bytes=8 * 2**20),
        num_workers=2,
        item_timeout_s=5.0,
        max_items_per_request=1000,
    )
    running = start_verifier(config)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def verifier_client(verifier, auth_token_file):
    from services.verifier.client import VerifierClient

    token = auth_token_file.read_text().strip()
    with VerifierClient(f"127.0.0.1:{verifier.port}", token=token, chunk_items=500) as client:
        yield client
