"""Mistakes that need a real server or socket: a taken port, an unreachable Redis, a Redis folder in use, a
wrong token. The real `rlep` console script runs each; it must exit non-zero with a short message and no traceback.
"""

from __future__ import annotations

import fcntl
import socket
import subprocess

import pytest

from rlep.common.ports import free_port
from rlep.common.redis_server import LOCK_FILE
from tests.service_process import rlep_command

pytestmark = pytest.mark.integration


def refused(args: list[str], *needles: str) -> str:
    """Runs `rlep args`; asserts a non-zero exit and an `error:` line holding every needle, without a traceback."""
    result = subprocess.run([*rlep_command(), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], result.stderr
    return errors[0]


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("service", ["verifier", "eval"])
def test_serve_on_a_port_in_use_says_so(service, taken_port):
    extra = ["--set", "num_workers=1"] if service == "verifier" else []
    refused(["serve", service, "--port", str(taken_port), *extra], f"127.0.0.1:{taken_port}", "in use", "--port")


@pytest.mark.parametrize("service", ["eval", "replay"])
def test_serve_with_an_unreachable_redis_names_it(service):
    url = f"redis://127.0.0.1:{free_port()}/0"
    refused(["serve", service, "--port", "0", "--set", f"redis_url={url}"], f"Redis at {url}", "redis_url")


@pytest.mark.parametrize("service", ["eval", "replay"])
def test_an_unreachable_redis_is_named_without_its_password(service):
    port = free_port()
    args = ["serve", service, "--port", "0", "--set", f"redis_url=redis://:hunter2-pw@127.0.0.1:{port}/0"]
    refused(args, f"Redis at redis://:***@127.0.0.1:{port}/0")
    verbose = subprocess.run([*rlep_command(), "--verbose", *args], capture_output=True, text=True, timeout=120)
    assert "Traceback" in verbose.stderr  # the whole story, every message in it masked
    assert "hunter2" not in verbose.stdout + verbose.stderr


def test_serve_replay_on_a_redis_folder_in_use_says_so(tmp_path):
    folder = tmp_path / "redis"
    folder.mkdir()
    with (folder / LOCK_FILE).open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live redis owner holds it
        refused(["serve", "replay", "--port", "0", "--set", f"local_redis_dir={folder}"], str(folder), "in use")


def test_pool_with_a_wrong_token_says_the_service_refused_it(replay, tmp_path):
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token\n")
    address = f"127.0.0.1:{replay.port}"
    refused(["pool", "list", "-a", address, "--auth-token-file", str(wrong)], address, "refused the auth token")


def test_pool_stats_of_a_missing_pool_says_how_to_list_them(replay, auth_token_file):
    address = f"127.0.0.1:{replay.port}"
    args = ["pool", "stats", "no-such-pool", "-a", address, "--auth-token-file", str(auth_token_file)]
    refused(args, "NOT_FOUND", "rlep pool list")
