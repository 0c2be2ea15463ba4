"""Verifier on Ray Serve: one replica runs the standalone verifier (worker pool + gRPC server) inside it.

Serve adds placement, health checks and restarts; clients still speak the same gRPC contract, at the
address the config names. The port is the config's own (default 50061), not a free one, so the learner
and eval can be pointed at `<node>:50061` without a registry: run one replica per node (the default
`num_replicas: 1`). `deploy/ray/serve.yaml` deploys it with `serve deploy` (import path
`rlep.services.verifier.ray_app:app_builder`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ray import serve

from rlep.common.config import load_config
from rlep.common.types import Verdict
from rlep.services.verifier.config import VerifierConfig

log = logging.getLogger(__name__)
# Serve calls check_health every 10 s; a busy pool queues the probe behind real work, so allow it time,
# but less than Serve's own health-check timeout (30 s), so our message is what shows up.
HEALTH_CHECK_TIMEOUT_S = 20.0


@serve.deployment(name="verifier", health_check_period_s=10, health_check_timeout_s=30)
class VerifierReplica:
    def __init__(self, config: dict[str, Any]):
        from rlep.services.verifier.main import start_verifier

        parsed = VerifierConfig.model_validate(config)
        self._running = start_verifier(parsed)
        self.address = f"{parsed.server.host}:{self._running.port}"
        log.info("verifier replica serving on %s with %d workers", self.address, parsed.num_workers)

    def get_address(self) -> str:
        return self.address

    def check_health(self) -> None:
        # One trivial check through the pool: proves a worker answers, not merely that processes exist
        # (past the verdict cache, which would answer it without any worker after the first probe).
        pool = self._running.pool
        [result] = pool.verify([(r"\boxed{1}", "1")], timeout_s=HEALTH_CHECK_TIMEOUT_S, use_cache=False)
        if result.verdict != Verdict.CORRECT:
            raise RuntimeError(f"the verifier pool answered {result.verdict.value} to a trivial check")

    def __del__(self) -> None:
        # Best effort: Serve tears replicas down in any state.
        with contextlib.suppress(Exception):
            self._running.stop(grace_s=1.0)


def build_app(config: VerifierConfig, num_replicas: int = 1):
    """A Serve application of the verifier; the replica reserves one CPU per math-verify worker."""
    return VerifierReplica.options(num_replicas=num_replicas, ray_actor_options={"num_cpus": config.num_workers}).bind(
        config.model_dump(mode="json")
    )


def app_builder(args: dict[str, Any]):
    """Entry point for `serve deploy` / `serve run`: args = {config: {...VerifierConfig...}, num_replicas}."""
    config = load_config(VerifierConfig, args.get("config", {}), env_prefix="verifier")
    return build_app(config, int(args.get("num_replicas", 1)))
