"""Verifier entry point: config -> worker pool and scorers -> gRPC server (+ /metrics)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rlep.common.lifecycle import RunningService, serve_until_signal, start_service
from rlep.common.metrics import service_registry
from rlep.services.verifier.config import VerifierConfig
from rlep.services.verifier.judge import CheckOptions
from rlep.services.verifier.pool import VerifyPool
from rlep.services.verifier.python_scorer import use_scorer_path
from rlep.services.verifier.routing import Scorers, scorer_labels
from rlep.services.verifier.server import SERVICE, VerifierMetrics, VerifierServicer

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RunningVerifier(RunningService):
    """A started verifier; its worker processes and HTTP scorers stop after the server."""

    pool: VerifyPool
    scorers: Scorers

    def close(self) -> None:
        self.scorers.close()
        self.pool.close()


def start_verifier(config: VerifierConfig) -> RunningVerifier:
    use_scorer_path(config.scorer_path)  # before the pool: its workers import the scorers from there too
    registry = service_registry("verifier")
    metrics = VerifierMetrics(registry, scorer_labels(config))
    pool = VerifyPool(
        num_workers=config.num_workers,
        item_timeout_s=config.item_timeout_s,
        options=CheckOptions(max_answer_chars=config.max_answer_chars, parse_timeout_s=config.parse_timeout_s),
        memory_limit_mb=config.worker_memory_mb,
        verdict_cache_size=config.verdict_cache_size,
        parse_cache_size=config.parse_cache_size,
        on_restart=lambda reason: metrics.worker_restarts.labels(reason).inc(),
        on_skip=metrics.items_dropped.inc,
        on_cache=metrics.count_cache_lookups,
    )
    metrics.workers.set(config.num_workers)
    try:
        scorers = Scorers(config, pool, on_skip=metrics.items_dropped.inc)
    except ValueError:  # a Python scorer that cannot be imported, an unreadable token file
        pool.close()
        raise
    servicer = VerifierServicer(scorers, config, metrics)
    return start_service(
        RunningVerifier,
        config.server,
        SERVICE,
        servicer,
        registry,
        metrics.requests,
        by_method=False,
        pool=pool,
        scorers=scorers,
    )


def serve_forever(config: VerifierConfig) -> None:
    """Runs until SIGINT/SIGTERM."""
    running = start_verifier(config)
    log.info("verifier listening on %s:%d (metrics port %s)", config.server.host, running.port, running.metrics_port)
    serve_until_signal(
        running,
        f"verifier listening on {config.server.host}:{running.port} {running.side_ports} workers={config.num_workers}",
    )
