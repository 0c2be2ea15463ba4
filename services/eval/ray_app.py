"""Eval on Ray Serve: one replica runs the standalone eval service (REST API + job runner) inside it.

The REST API listens where the config says (default port 8080), not behind Serve's HTTP proxy, so
its routes, auth and /metrics are exactly those of `rlep serve eval`. What Ray adds is discovery:
with `rollout_app` set, the replica reads the rollout replicas' addresses from that application's
registry (services/rollout/ray_app.py) instead of a fixed list. `deploy/ray/serve.yaml` deploys it
with `serve deploy` (import path `rlep.services.eval.ray_app:app_builder`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ray import serve

from rlep.common.config import load_config
from rlep.services.eval.config import EvalConfig

log = logging.getLogger(__name__)
# How long a starting replica waits for the rollout replicas to register (vLLM may still be loading).
ROLLOUT_WAIT_S = 600.0


@serve.deployment(name="eval", health_check_period_s=10)
class EvalReplica:
    def __init__(self, config: dict[str, Any], rollout_app: str | None = None):
        from rlep.services.eval.main import start_eval

        if rollout_app:
            from rlep.services.rollout.client import replica_addresses_on_ray

            addresses = replica_addresses_on_ray(rollout_app, wait_s=ROLLOUT_WAIT_S)
            config = {**config, "rollout": {**config.get("rollout", {}), "addresses": addresses}}
        self._running = start_eval(load_config(EvalConfig, config, env_prefix="eval"))
        log.info("eval replica serving on %s", self._running.url)

    def get_url(self) -> str:
        return self._running.url

    def check_health(self) -> None:
        if not self._running.http.alive:
            raise RuntimeError("the eval HTTP server thread stopped")
        if reason := self._running.failure:
            raise RuntimeError(reason)

    def __del__(self) -> None:
        # Best effort: Serve tears replicas down in any state.
        with contextlib.suppress(Exception):
            self._running.stop(grace_s=1.0)


def app_builder(args: dict[str, Any]):
    """Entry point for `serve deploy` / `serve run`: args = {config: {...EvalConfig...}, rollout_app}.

    With `rollout_app`, `config.rollout.addresses` may be left out: the replica looks them up at start.
    """
    config = dict(args.get("config", {}))
    rollout_app = args.get("rollout_app")
    if rollout_app:
        # A placeholder passes validation here; the replica replaces it with the registered addresses.
        config["rollout"] = {"addresses": ["registry:0"], **config.get("rollout", {})}
    load_config(EvalConfig, config, env_prefix="eval")  # fail at deploy time on a bad config, not in every replica
    return EvalReplica.options(num_replicas=1).bind(config, rollout_app)
