"""What every service's main does around its own wiring: starting its gRPC server with the shared
interceptors and the metrics endpoint, stopping them in order, and waiting for a stop signal.

A service's `Running*` handle is a `RunningService` subclass that adds the parts only it holds (a
worker pool, a store, an engine) and releases them in `close()`, after its servers have stopped.
"""

from __future__ import annotations

import faulthandler
import signal
import threading
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry, Counter

from rlep.common.config import ServerConfig
from rlep.common.grpc_interceptors import StatusCountInterceptor
from rlep.common.grpc_server import add_validated_servicer, build_server
from rlep.common.health_port import HealthPort, private_socket
from rlep.common.metrics import MetricsServer
from rlep.common.tls import server_ssl_context

# Seconds in-flight RPCs get to finish when a service stops.
STOP_GRACE_S = 2.0


def start_metrics(registry: CollectorRegistry, config: ServerConfig) -> MetricsServer | None:
    """Serves `registry` on the configured metrics port (same host, token and TLS as gRPC), or nothing."""
    if config.metrics_port is None:
        return None
    return MetricsServer(
        registry, config.host, config.metrics_port, config.read_auth_token(), server_ssl_context(config)
    )


@dataclass(kw_only=True)
class RunningService:
    """A started gRPC service; `stop()` shuts the server, the metrics endpoint, then the service's own parts down."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    metrics_server: MetricsServer | None
    health_port_server: HealthPort | None = None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    @property
    def health_port(self) -> int | None:
        return self.health_port_server.port if self.health_port_server else None

    @property
    def side_ports(self) -> str:
        """The banner's words for the other ports: `metrics=P` and, when on, ` health_port=P`."""
        health_port = f" health_port={self.health_port}" if self.health_port_server else ""
        return f"metrics={self.metrics_port}{health_port}"

    def close(self) -> None:
        """Releases what the service holds besides its servers; runs once they have stopped."""

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self.health.enter_graceful_shutdown()  # probes and load balancers stop sending work first
        if self.health_port_server:
            self.health_port_server.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()  # calls still running then are cancelled
        if self.health_port_server:
            self.health_port_server.stop()
        if self.metrics_server:
            self.metrics_server.stop()
        self.close()


RunningT = TypeVar("RunningT", bound=RunningService)


def start_service(
    running_cls: type[RunningT],
    config: ServerConfig,
    service: ServiceDescriptor,
    servicer: object,
    registry: CollectorRegistry,
    requests: Counter,
    /,
    by_method: bool = True,
    **parts: Any,
) -> RunningT:
    """Serves `servicer` for `service` with every call counted into `requests` (labels `method, code`, or
    `code` alone when `by_method` is False) and `registry` on the metrics port.
    Returns `running_cls(..., **parts)`; `parts` are the subclass's own fields."""
    local = private_socket() if config.health_port is not None else None
    server, port, health_servicer = build_server(
        config,
        lambda s: add_validated_servicer(s, service, servicer, config.max_request_bytes),
        [service.full_name],
        [StatusCountInterceptor(requests, service.full_name, by_method)],
        local_target=local,
    )
    health_port = None
    if local is not None:
        health_port = HealthPort(config.host, config.health_port, local, ["", service.full_name], config.health_stall_s)
        health_port.wait_first_check(timeout_s=config.health_stall_s)  # SERVING there once the service is up
    metrics_server = start_metrics(registry, config)
    return running_cls(
        server=server,
        port=port,
        health=health_servicer,
        metrics_server=metrics_server,
        health_port_server=health_port,
        **parts,
    )


class Stoppable(Protocol):
    def stop(self) -> None: ...


STACK_DUMP_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """`kill -USR1 <pid>` writes every thread's stack to stderr and the process goes on: how an operator (or a test
    whose service did not start in time) sees where a stuck start or call waits, without py-spy. Child processes
    forked after this (vLLM's engine core, where the platform forks) inherit it. File descriptor 2, not
    `sys.stderr`: a command run in process (typer's CliRunner) replaces that with a stream that has no descriptor."""
    faulthandler.register(STACK_DUMP_SIGNAL, file=2, all_threads=True, chain=False)


def stop_on_signal() -> threading.Event:
    """An event set by SIGINT or SIGTERM (Ctrl-C, `kill`, Kubernetes shutting the pod down)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop_signal() -> None:
    """Blocks until SIGINT or SIGTERM."""
    stop_on_signal().wait()


def serve_until_signal(running: Stoppable, banner: str) -> None:
    """Prints `banner` (the line scripts and tests wait for), then runs until SIGINT/SIGTERM and stops `running`."""
    print(banner, flush=True)
    wait_for_stop_signal()
    running.stop()
