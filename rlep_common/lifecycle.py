"""What every service's main does around its own wiring: the metrics endpoint and waiting for a stop."""

from __future__ import annotations

import signal
import threading

from prometheus_client import CollectorRegistry

from rlep.common.config import ServerConfig
from rlep.common.metrics import MetricsServer
from rlep.common.tls import server_ssl_context


def start_metrics(registry: CollectorRegistry, config: ServerConfig) -> MetricsServer | None:
    """Serves `registry` on the configured metrics port (same host, token and TLS as gRPC), or nothing."""
    if config.metrics_port is None:
        return None
    return MetricsServer(
        registry, config.host, config.metrics_port, config.read_auth_token(), server_ssl_context(config)
    )


def wait_for_stop_signal() -> None:
    """Blocks until SIGINT or SIGTERM (Ctrl-C, `kill`, Kubernetes shutting the pod down)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
