"""Rollout worker entry point: config -> vLLM engine -> gRPC server (+ /metrics)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from rlep_common.grpc_utils import add_validated_servicer, build_server
from rlep_common.lifecycle import start_metrics, wait_for_stop_signal
from rlep_common.metrics import MetricsServer, service_registry
from services.rollout.config import RolloutConfig
from services.rollout.engine import RolloutEngine
from services.rollout.server import SERVICE, RolloutMetrics, RolloutServicer

log = logging.getLogger(__name__)


@dataclass
class RunningRollout:
    """A started worker; `stop()` shuts the server, the metrics endpoint and the engine down."""

    server: grpc.Server
    port: int
    engine: RolloutEngine
    metrics_server: MetricsServer | None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    def stop(self, grace_s: float = 2.0) -> None:
        self.server.stop(grace_s).wait()
        if self.metrics_server:
            self.metrics_server.stop()
        self.engine.close()


def start_rollout(config: RolloutConfig) -> RunningRollout:
    registry = service_registry("rollout")
    metrics = RolloutMetrics(registry)
    engine = RolloutEngine(config.engine, config.initial_version, config.max_batch_prompts)
    try:
        servicer = RolloutServicer(engine, config, metrics)
        server, port, _ = build_server(
            config.server, lambda s: add_validated_servicer(s, SERVICE, servicer), [SERVICE.full_name]
        )
        metrics_server = start_metrics(registry, config.server)
    except BaseException:
        engine.close()
        raise
    return RunningRollout(server, port, engine, metrics_server)


def serve_forever(config: RolloutConfig) -> None:
    """Runs until SIGINT/SIGTERM."""
    running = start_rollout(config)
    print(
        f"rollout listening on {config.server.host}:{running.port} metrics={running.metrics_port}"
        f" model={running.engine.model_path} version={running.engine.version}",
        flush=True,
    )
    wait_for_stop_signal()
    running.stop()
