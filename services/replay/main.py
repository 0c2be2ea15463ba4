"""Replay entry point: config -> Redis (given, or self-started) -> store -> gRPC server (+ /metrics)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import redis

from rlep.common.grpc_utils import add_validated_servicer, build_server
from rlep.common.lifecycle import start_metrics, wait_for_stop_signal
from rlep.common.metrics import MetricsServer, service_registry
from rlep.common.redis_server import LocalRedis, start_local_redis
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.server import SERVICE, ReplayMetrics, ReplayServicer
from rlep.services.replay.store import RedisReplayStore


@dataclass
class RunningReplay:
    server: grpc.Server
    port: int
    store: RedisReplayStore
    servicer: ReplayServicer
    metrics_server: MetricsServer | None
    local_redis: LocalRedis | None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    def stop(self, grace_s: float = 2.0) -> None:
        self.server.stop(grace_s).wait()
        if self.metrics_server:
            self.metrics_server.stop()
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
    servicer = ReplayServicer(store, config, ReplayMetrics(registry))
    server, port, _ = build_server(
        config.server, lambda s: add_validated_servicer(s, SERVICE, servicer), [SERVICE.full_name]
    )
    metrics_server = start_metrics(registry, config.server)
    return RunningReplay(server, port, store, servicer, metrics_server, local)


def serve_forever(config: ReplayConfig) -> None:
    running = start_replay(config)
    where = running.local_redis.url if running.local_redis else "configured Redis"
    print(
        f"replay listening on {config.server.host}:{running.port} metrics={running.metrics_port} redis={where}",
        flush=True,
    )
    wait_for_stop_signal()
    running.stop()
