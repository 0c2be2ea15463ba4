"""Rollout worker entry point: config -> vLLM engine -> gRPC server (+ /metrics), a watchdog, stopping.

A worker whose engine thread or vLLM engine core died cannot generate again, so it must not look
healthy: the watchdog turns the gRPC health check NOT_SERVING, releases every waiting caller with
UNAVAILABLE (clients retry elsewhere) and, for `rlep serve rollout`, ends the process with a non-zero
status so its supervisor (Kubernetes, compose, systemd) starts a new one. Under Ray Serve,
`RolloutReplica.check_health` reads the same failure and Serve replaces the replica.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from grpc_health.v1 import health

from rlep.common.lifecycle import RunningService, start_service, stop_on_signal
from rlep.common.metrics import service_registry
from rlep.services.rollout.config import RolloutConfig
from rlep.services.rollout.engine import RolloutEngine
from rlep.services.rollout.server import SERVICE, RolloutMetrics, RolloutServicer
from rlep.services.weights.staging import default_staging_dir, sweep_stale

log = logging.getLogger(__name__)

# How often the watchdog looks at the engine: a dead engine is noticed within this, plus a stop.
WATCHDOG_PERIOD_S = 0.5
# Seconds in-flight RPCs get to finish when the worker stops (a running batch is aborted anyway).
STOP_GRACE_S = 1.0
# A stop that has not finished by then (a stuck thread) ends the process the hard way.
HARD_EXIT_AFTER_S = 15.0
ENGINE_FAILED_EXIT_CODE = 3


class EngineWatchdog:
    """Retires a worker whose engine died: health NOT_SERVING, waiting callers released, `on_failure(reason)`."""

    def __init__(
        self,
        failure: Callable[[], str | None],
        release: Callable[[str], object],
        health_servicer: health.HealthServicer,
        on_failure: Callable[[str], None] | None = None,
        period_s: float = WATCHDOG_PERIOD_S,
    ):
        self._failure, self._release, self._health, self._on_failure = failure, release, health_servicer, on_failure
        self._period_s = period_s
        self._stop = threading.Event()
        self.reason: str | None = None
        self.tripped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rollout-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._period_s):
            reason = self._failure()
            if reason is None:
                continue
            log.error("rollout worker retiring: %s", reason)
            self.reason = reason
            self._health.enter_graceful_shutdown()  # every service name NOT_SERVING, for good
            self._release(reason)
            self.tripped.set()
            if self._on_failure is not None:
                self._on_failure(reason)
            return

    def stop(self) -> None:
        self._stop.set()


@dataclass(kw_only=True)
class RunningRollout(RunningService):
    """A started worker; its engine stops after the server (its watchdog before anything)."""

    engine: RolloutEngine
    watchdog: EngineWatchdog = field(init=False)  # watches the engine once the health service exists

    def close(self) -> None:
        self.engine.close()  # aborts any batch at its next step and releases whoever still waits

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self.watchdog.stop()  # stopping the engine below is no failure to report
        super().stop(grace_s)  # calls still running after the grace are cancelled: their requests get aborted


def start_rollout(config: RolloutConfig, on_failure: Callable[[str], None] | None = None) -> RunningRollout:
    """Starts a worker. `on_failure(reason)` runs (watchdog thread) when its engine dies."""
    # Payload files of a killed worker or learner on this host take shared memory until removed.
    sweep_stale([config.staging_dir, default_staging_dir()])
    registry = service_registry("rollout")
    metrics = RolloutMetrics(registry)
    engine = RolloutEngine(config.engine, config.initial_version, config.max_batch_prompts)
    try:
        servicer = RolloutServicer(engine, config, metrics)
        running = start_service(
            RunningRollout, config.server, SERVICE, servicer, registry, metrics.requests, engine=engine
        )
    except BaseException:
        engine.close()
        raise
    running.watchdog = EngineWatchdog(lambda: engine.failure, engine.fail_waiting, running.health, on_failure)
    return running


def serve_forever(config: RolloutConfig) -> None:
    """Runs until SIGINT/SIGTERM (exit 0) or until the engine dies (exit ENGINE_FAILED_EXIT_CODE)."""
    stop = stop_on_signal()
    running = start_rollout(config, on_failure=lambda _: stop.set())
    print(
        f"rollout listening on {config.server.host}:{running.port} {running.side_ports}"
        f" model={running.engine.model_path} version={running.engine.version}",
        flush=True,
    )
    stop.wait()
    code = ENGINE_FAILED_EXIT_CODE if running.watchdog.reason else 0
    hard_exit = threading.Timer(HARD_EXIT_AFTER_S, os._exit, (code or 1,))
    hard_exit.daemon = True
    hard_exit.start()
    running.stop()
    sys.exit(code)
