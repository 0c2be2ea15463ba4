"""The embedded Redis's start after an unlucky stop: an empty password file, a FATAL error, a long AOF load."""

from __future__ import annotations

import stat
import time

import pytest
import redis

from rlep.common import redis_server
from rlep.common.redis_server import LOG_FILE, PASSWORD_FILE, start_local_redis

pytestmark = pytest.mark.integration


def test_an_empty_password_file_gets_a_new_password(tmp_path):
    """A power cut during the first start can leave `redis.password` empty; the next start must still serve."""
    data_dir = tmp_path / "redis"
    data_dir.mkdir()
    (data_dir / PASSWORD_FILE).write_text("")
    server = start_local_redis(data_dir)
    try:
        assert redis.Redis.from_url(server.url, socket_timeout=5).ping()
        kept = data_dir / PASSWORD_FILE
        assert len(server.password) == 48 and kept.read_text().strip() == server.password
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        assert not list(data_dir.glob(".*.partial"))  # the atomic write left no temporary behind
    finally:
        server.stop()


def test_a_failed_start_quotes_redis_fatal_line(tmp_path):
    """redis-server prints a config error on stderr before it opens its log file; the error and the log keep it."""
    data_dir = tmp_path / "redis"
    with pytest.raises(RuntimeError, match="FATAL CONFIG") as refused:
        start_local_redis(data_dir, extra_args=["--no-such-directive", "1"])
    assert "no-such-directive" in str(refused.value)
    assert "FATAL CONFIG" in (data_dir / LOG_FILE).read_text()


@pytest.mark.slow
def test_the_start_waits_while_redis_loads_its_aof(tmp_path, monkeypatch):
    """An AOF that takes longer to load than the start bound (75,000 keys at ~0.2 ms each, 15-25 s, against 1.5 s)
    still starts: Redis answers LOADING meanwhile, which is progress, not a hung server. The load outlasts what
    redis-py's own retries (which the start turns off) hide inside one ping: ~5-10 s of LOADING answers."""
    data_dir = tmp_path / "redis"
    server = start_local_redis(data_dir)
    pipe = redis.Redis.from_url(server.url, socket_timeout=5).pipeline(transaction=False)
    for key in range(75_000):
        pipe.set(f"k{key}", "v")
    pipe.execute()
    server.stop()
    monkeypatch.setattr(redis_server, "REDIS_START_TIMEOUT_S", 1.5)
    started = time.monotonic()
    # 0.1 ms of sleep per key loaded; Redis answers (LOADING) every 1,024 commands loaded, here every ~0.2 s.
    server = start_local_redis(data_dir, extra_args=["--key-load-delay", "100"])
    try:
        assert time.monotonic() - started > 1.5  # the load did outlast the bound
        assert redis.Redis.from_url(server.url, socket_timeout=5).dbsize() == 75_000
    finally:
        server.stop()
