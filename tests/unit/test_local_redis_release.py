"""A supervisor that saw its redis-server die releases it (pid file, the data directory's lock) while the owner may
be stopping or killing it: both closed the lock file at once and one got "I/O operation on closed file" (CI,
test_embedded_redis_supervision). Pure logic: the lock file is a stand-in whose close can be caught overlapping."""

from __future__ import annotations

import subprocess
import threading

from rlep.common.redis_server import LocalRedis


class OverlapCatchingLock:
    """A lock file whose first close waits (up to 1 s) for a second close to start, as a close syscall that releases
    the GIL lets it; `closes` counts the closes that started."""

    def __init__(self):
        self.closes = 0
        self.second = threading.Event()

    def close(self) -> None:
        self.closes += 1
        if self.closes == 1:
            self.second.wait(timeout=1.0)  # the whole test's wait when releases do not overlap (the fix)
        else:
            self.second.set()


def test_two_releases_at_once_close_the_lock_file_once(tmp_path):
    lock = OverlapCatchingLock()
    process = subprocess.Popen(["true"])
    process.wait()
    server = LocalRedis(process, 0, tmp_path, "password", lock)  # type: ignore[arg-type]
    started = threading.Barrier(2)

    def release() -> None:
        started.wait()
        server._release()

    threads = [threading.Thread(target=release) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert lock.closes == 1 and server.lock is None
