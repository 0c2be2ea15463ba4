"""The embedded Redis: one server per data directory across owner crashes, and a password."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import redis

from rlep.common.redis_server import PASSWORD_FILE, _is_our_redis, _pid_alive, start_local_redis
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.integration

# The owner is its own process, so the test can kill -9 it as a crash would.
OWNER = """
import sys
from pathlib import Path
from rlep.common.redis_server import start_local_redis
kwargs = {} if sys.argv[2] == "default" else {"die_with_owner": False}
server = start_local_redis(Path(sys.argv[1]), **kwargs)
print(server.url, server.process.pid, flush=True)
sys.stdin.read()
"""


def start_owner(data_dir, mode: str) -> tuple[subprocess.Popen, str, int]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(data_dir), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    url, pid = owner.stdout.readline().split()
    return owner, url, int(pid)


def wait_for_rewrite(url: str) -> None:
    """Asks a server to rewrite its AOF and waits until it has; nothing when no server answers there."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=5)
    with contextlib.suppress(redis.ConnectionError):
        client.bgrewriteaof()
        while True:
            info = client.info("persistence")
            if not (info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]):
                return


@pytest.mark.parametrize("mode", ["default", "no_pdeathsig"])
def test_kill_9_of_the_owner_loses_no_acknowledged_write(tmp_path, mode):
    """`no_pdeathsig` is an OS without PR_SET_PDEATHSIG: the orphan outlives its owner until the next start."""
    data_dir = tmp_path / "redis"
    owner, orphan_url, orphan_pid = start_owner(data_dir, mode)
    try:
        redis.Redis.from_url(orphan_url).set("before-crash", 1)
        owner.kill()  # kill -9 of the owner; its redis-server is not told
        owner.wait()
        if mode == "default":  # PR_SET_PDEATHSIG: the server goes with its owner, before any new start
            deadline = time.monotonic() + 30
            while _pid_alive(orphan_pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not _pid_alive(orphan_pid)
        second = start_local_redis(data_dir)
        client = redis.Redis.from_url(second.url)
        acknowledged = sum(client.sadd("acknowledged", f"write-{i}") for i in range(51))
        # A server still running on the directory would rewrite the AOF without the writes above.
        wait_for_rewrite(orphan_url)
        second.stop()
        third = start_local_redis(data_dir)
        try:
            client = redis.Redis.from_url(third.url)
            assert acknowledged == 51
            assert client.scard("acknowledged") == 51  # zero acknowledged writes lost
            assert client.get("before-crash") == b"1"
        finally:
            third.stop()
    finally:
        if _is_our_redis(orphan_pid, data_dir.resolve()):  # only ever alive when the fix is broken
            os.kill(orphan_pid, signal.SIGKILL)
        owner.kill()


def test_a_live_owner_keeps_its_directory(tmp_path, monkeypatch):
    import rlep.common.redis_server

    monkeypatch.setattr(rlep.common.redis_server, "LOCK_WAIT_S", 0.5)  # a live owner never lets go
    data_dir = tmp_path / "redis"
    owner, url, server_pid = start_owner(data_dir, "default")
    try:
        with pytest.raises(RuntimeError, match=f"in use by another redis owner \\(pid {owner.pid}\\)"):
            start_local_redis(data_dir)
        assert redis.Redis.from_url(url).ping()  # still served by its owner
    finally:
        owner.kill()
        owner.wait()
        if _is_our_redis(server_pid, data_dir.resolve()):  # gone with its owner, unless PDEATHSIG is broken
            os.kill(server_pid, signal.SIGKILL)


def test_the_embedded_redis_needs_its_password(tmp_path):
    data_dir = tmp_path / "redis"
    server = start_local_redis(data_dir)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        password = (data_dir / PASSWORD_FILE).read_text().strip()
        assert len(password) >= 32 and f":{password}@" in server.url
        assert stat.S_IMODE((data_dir / PASSWORD_FILE).stat().st_mode) == 0o600
        assert all(password not in arg for arg in server.process.args)  # `ps` shows the command line
        redis.Redis.from_url(server.url).set("k", "v")
    finally:
        server.stop()
    restarted = start_local_redis(data_dir)  # same password, same data
    try:
        assert restarted.url == server.url.replace(str(server.port), str(restarted.port))
        assert redis.Redis.from_url(restarted.url).get("k") == b"v"
    finally:
        restarted.stop()


def test_a_port_taken_before_the_server_binds_it_is_picked_again(tmp_path, monkeypatch, caplog):
    """The race of every picked port: another process (here another embedded Redis) binds it between the pick and
    redis-server's bind. The start picks another port and says so; a port the caller named is an error at once."""
    import rlep.common.redis_server

    other = start_local_redis(tmp_path / "other")
    picks = iter([other.port])
    real_free_port = rlep.common.redis_server.free_port
    monkeypatch.setattr(rlep.common.redis_server, "free_port", lambda: next(picks, None) or real_free_port())
    try:
        with caplog.at_level("WARNING", logger="rlep.common.redis_server"):
            server = start_local_redis(tmp_path / "redis")
        try:
            assert server.port != other.port and redis.Redis.from_url(server.url).ping()
            assert f"port {other.port} was taken" in caplog.text and "Address already in use" in caplog.text
        finally:
            server.stop()
        with pytest.raises(RuntimeError, match=f"could not bind 127.0.0.1:{other.port}.*Address already in use"):
            start_local_redis(tmp_path / "named", port=other.port)
        assert redis.Redis.from_url(other.url).ping()  # the other server is untouched
    finally:
        other.stop()
