"""Replay entry point: config -> Redis (given, or self-started) -> store -> gRPC server (+ /metrics)."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from rlep.common.config import redact_secrets
from rlep.common.lifecycle import RunningService, serve_until_signal, start_service
from rlep.common.metrics import service_registry
from rlep.common.redis_server import LocalRedis, start_local_redis
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.server import SERVICE, ReplayMetrics, ReplayServicer
from rlep.services.replay.store import RedisReplayStore


@dataclass(kw_only=True)
class RunningReplay(RunningService):
    """A started replay service; its Redis connection (and a self-started Redis) close after the server."""

    store: RedisReplayStore
    servicer: ReplayServicer
    local_redis: LocalRedis | None

    def close(self) -> None:
        self.store.client.close()
        if self.local_redis:
            self.local_redis.stop()


def start_replay(config: ReplayConfig) -> RunningReplay:
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
    return start_service(
        RunningReplay,
        config.server,
        SERVICE,
        servicer,
        registry,
        metrics.requests,
        store=store,
        servicer=servicer,
        local_redis=local,
    )


def serve_forever(config: ReplayConfig) -> None:
    running = start_replay(config)
    # The embedded Redis's URL carries its password: the banner shows where it is, never the secret.
    where = redact_secrets(running.local_redis.url) if running.local_redis else "configured Redis"
    serve_until_signal(
        running, f"replay listening on {config.server.host}:{running.port} metrics={running.metrics_port} redis={where}"
    )
