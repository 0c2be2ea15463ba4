"""Shared fixtures: free ports, the shared data sets, and expensive servers started once per session."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("RLEP_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "math500.jsonl").exists():
        pytest.fail(f"the shared data sets are expected at {SHARED_DATA} (a clone sits beside shared/)")
    return SHARED_DATA


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance (2 CPUs, no dashboard, no token auth), shared by every Ray test."""
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
