"""Replay entry point: config -> Redis (given, or self-started) -> store -> gRPC server (+ /metrics).

A self-started Redis is supervised (rlep_common/redis_supervisor.py): restarted on its port, data and password
when it dies; when it cannot be, the health check turns NOT_SERVING and `rlep serve replay` exits with status 3 for
its supervisor to start it again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from rlep.common.config import redact_secrets
from rlep.common.lifecycle import RunningService, start_service, stop_on_signal
from rlep.common.metrics import service_registry
from rlep.common.redis_server import LocalRedis, start_local_redis
from rlep.common.redis_supervisor import RedisSupervisor
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.server import SERVICE, ReplayMetrics, ReplayServicer
from rlep.services.replay.store import RedisReplayStore


@dataclass(kw_only=True)
class RunningReplay(RunningService):
    """A started replay service; its Redis connection (and a self-started Redis) close after the server."""

    store: RedisReplayStore
    servicer: ReplayServicer
    redis_supervisor: RedisSupervisor | None = field(default=None)  # a self-started Redis, kept alive

    @property
    def local_redis(self) -> LocalRedis | None:
        """The self-started redis-server now running (a restart replaces it), or None with a configured Redis."""
        return self.redis_supervisor.server if self.redis_supervisor else None

    def close(self) -> None:
        self.store.client.close()
        if self.redis_supervisor:
            self.redis_supervisor.stop()


EMBEDDED_REDIS_LOST_EXIT_CODE = 3


def start_replay(config: ReplayConfig, on_failure: Callable[[str], None] | None = None) -> RunningReplay:
    """Starts the service. `on_failure(reason)` runs when its self-started Redis is lost for good (after the health
    check turned NOT_SERVING)."""
    local = None
    url = config.redis_url
    if url is None:
        local = start_local_redis(config.local_redis_dir, appendfsync=config.local_redis_appendfsync)
        url = local.url
    client = redis.Redis.from_url(
        url, socket_timeout=config.redis_timeout_s, socket_connect_timeout=config.redis_timeout_s
    )
    client.ping()
    store = RedisReplayStore(client, config.capacity_per_question, config.eviction)
    registry = service_registry("replay")
    metrics = ReplayMetrics(registry)
    servicer = ReplayServicer(store, config, metrics)
    try:
        running = start_service(
            RunningReplay, config.server, SERVICE, servicer, registry, metrics.requests, store=store, servicer=servicer
        )
    except BaseException:
        if local:
            local.stop()
        raise
    if local:

        def lost(reason: str) -> None:
            running.health.enter_graceful_shutdown()  # every service name NOT_SERVING, for good
            if on_failure is not None:
                on_failure(reason)

        running.redis_supervisor = RedisSupervisor(local, lost)
    return running


def serve_forever(config: ReplayConfig) -> None:
    """Runs until SIGINT/SIGTERM (exit 0) or until its self-started Redis is lost for good (exit 3)."""
    stop = stop_on_signal()
    lost: list[str] = []
    running = start_replay(config, on_failure=lambda reason: (lost.append(reason), stop.set()))
    # The embedded Redis's URL carries its password: the banner shows where it is, never the secret.
    where = redact_secrets(running.local_redis.url) if running.local_redis else "configured Redis"
    print(
        f"replay listening on {config.server.host}:{running.port} {running.side_ports} redis={where}",
        flush=True,
    )
    stop.wait()
    running.stop()
    sys.exit(EMBEDDED_REDIS_LOST_EXIT_CODE if lost else 0)
