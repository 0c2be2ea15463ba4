"""Sandbox service entry point: config -> `Sandbox` -> gRPC server (+ /metrics, + the health port)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rlep.common.lifecycle import RunningService, serve_until_signal, start_service
from rlep.common.metrics import service_registry
from rlep.services.sandbox.config import SandboxServiceConfig
from rlep.services.sandbox.sandbox import Sandbox
from rlep.services.sandbox.server import SERVICE, SandboxMetrics, SandboxServicer

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RunningSandbox(RunningService):
    sandbox: Sandbox


def start_sandbox(config: SandboxServiceConfig) -> RunningSandbox:
    """Checks the sandbox's tools (interpreter, prlimit, setpriv as root, bwrap) before it listens: a host that lacks
    one fails here, naming the fix, not at the first call."""
    sandbox = Sandbox(config.sandbox)
    registry = service_registry("sandbox")
    metrics = SandboxMetrics(registry)
    servicer = SandboxServicer(sandbox, config, metrics)
    return start_service(
        RunningSandbox, config.server, SERVICE, servicer, registry, metrics.requests, by_method=False, sandbox=sandbox
    )


def serve_forever(config: SandboxServiceConfig) -> None:
    """Runs until SIGINT/SIGTERM."""
    running = start_sandbox(config)
    sandbox = config.sandbox
    log.info("sandbox listening on %s:%d (metrics port %s)", config.server.host, running.port, running.metrics_port)
    serve_until_signal(
        running,
        f"sandbox listening on {config.server.host}:{running.port} {running.side_ports} "
        f"isolation={sandbox.isolation} concurrency={sandbox.concurrency}",
    )
