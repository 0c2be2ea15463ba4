"""Verifier entry point: config -> worker pool -> gRPC server (+ /metrics)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from rlep.common.grpc_utils import add_validated_servicer, build_server
from rlep.common.lifecycle import start_metrics, wait_for_stop_signal
from rlep.common.metrics import MetricsServer, service_registry
from rlep.services.verifier.config import VerifierConfig
from rlep.services.verifier.core import CheckOptions
from rlep.services.verifier.pool import VerifyPool
from rlep.services.verifier.server import SERVICE, VerifierMetrics, VerifierServicer

log = logging.getLogger(__name__)


@dataclass
class RunningVerifier:
    """A started verifier; `stop()` shuts the server, the metrics endpoint and the workers down."""

    server: grpc.Server
    port: int
    pool: VerifyPool
    metrics_server: MetricsServer | None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    def stop(self, grace_s: float = 2.0) -> None:
        self.server.stop(grace_s).wait()
        if self.metrics_server:
            self.metrics_server.stop()
        self.pool.close()


def start_verifier(config: VerifierConfig) -> RunningVerifier:
    registry = service_registry("verifier")
    metrics = VerifierMetrics(registry)
    pool = VerifyPool(
        num_workers=config.num_workers,
        item_timeout_s=config.item_timeout_s,
        options=CheckOptions(max_answer_chars=config.max_answer_chars, parse_timeout_s=config.parse_timeout_s),
        memory_limit_mb=config.worker_memory_mb,
        on_restart=lambda reason: metrics.worker_restarts.labels(reason).inc(),
        on_skip=metrics.items_dropped.inc,
    )
    metrics.workers.set(config.num_workers)
    servicer = VerifierServicer(pool, config, metrics)
    server, port, _ = build_server(
        config.server, lambda s: add_validated_servicer(s, SERVICE, servicer), [SERVICE.full_name]
    )
    metrics_server = start_metrics(registry, config.server)
    return RunningVerifier(server, port, pool, metrics_server)


def serve_forever(config: VerifierConfig) -> None:
    """Runs until SIGINT/SIGTERM."""
    running = start_verifier(config)
    log.info("verifier listening on %s:%d (metrics port %s)", config.server.host, running.port, running.metrics_port)
    print(
        f"verifier listening on {config.server.host}:{running.port}"
        f" metrics={running.metrics_port} workers={config.num_workers}",
        flush=True,
    )
    wait_for_stop_signal()
    running.stop()
