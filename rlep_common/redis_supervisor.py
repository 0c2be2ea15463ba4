"""Keeps an embedded redis-server (redis_server.py) alive for the service that started it.

A thread waits on the server process. When it exits without being stopped (killed, crashed, OOM), the supervisor
starts it again on the same port, data directory (its AOF) and password, so the service's Redis client reconnects
on its next call and "retrying is safe" holds. When it cannot (`attempts` starts failed: a corrupted AOF, a port
taken meanwhile), it calls `on_lost(reason)`: the service turns NOT_SERVING and exits for its supervisor
(Kubernetes, compose, Ray) to restart it, instead of answering UNAVAILABLE for ever while looking healthy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rlep.common.redis_server import LocalRedis, start_local_redis

log = logging.getLogger(__name__)

RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 0.5  # doubled after each failed start: 0.5, 1, 2 s


class RedisSupervisor:
    def __init__(
        self,
        server: LocalRedis,
        on_lost: Callable[[str], None],
        attempts: int = RESTART_ATTEMPTS,
        backoff_s: float = RESTART_BACKOFF_S,
    ):
        self.server = server
        self.restarts = 0
        self.lost: str | None = None
        self._on_lost, self._attempts, self._backoff_s = on_lost, attempts, backoff_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="redis-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            code = self.server.process.wait()
            if self._stopping.is_set():
                return
            log.error("embedded redis-server (port %d) exited with status %s; restarting it", self.server.port, code)
            if not self._restart():
                return

    def _restart(self) -> bool:
        started, pause, error = time.monotonic(), self._backoff_s, None
        self.server.kill()  # reaps it and releases its data directory's lock for the new server
        for attempt in range(1, self._attempts + 1):
            try:
                old = self.server
                self.server = start_local_redis(
                    old.data_dir, port=old.port, appendfsync=old.appendfsync, extra_args=old.extra_args
                )
            except Exception as err:  # noqa: BLE001 - any failure to start counts as one attempt
                error = err
                log.warning("restarting redis-server, attempt %d of %d: %s", attempt, self._attempts, err)
                if self._stopping.wait(pause):
                    return False
                pause *= 2
                continue
            self.restarts += 1
            log.warning(
                "embedded redis-server restarted on port %d in %.1f s (restart %d)",
                self.server.port,
                time.monotonic() - started,
                self.restarts,
            )
            return True
        self.lost = f"the embedded redis-server died and could not be restarted ({self._attempts} tries): {error}"
        log.error("%s", self.lost)
        self._on_lost(self.lost)
        return False

    def stop(self) -> None:
        """Stops the server for good (a stop is no exit to repair)."""
        self._stopping.set()
        self.server.stop()
        self._thread.join(timeout=10)
