"""Rollout on Ray Serve: N replicas, one vLLM engine and one gRPC server each.

Serve owns the replicas' lifecycle (placement, health checks, restarts). The learner needs more
than Serve's request routing gives: it must reach *every* replica (a weight push goes to all of
them) and split one batch across them. So each replica serves the same gRPC contract as a
standalone worker and records its address in a small named actor, the registry; the typed client
reads the addresses from there (`RolloutClient.from_ray`). A replica that Serve restarts registers
its new address and starts at its initial version; the learner brings it up to date before use.

    serve.run(build_app(RolloutConfig(), num_replicas=2), name="rlep-rollout", route_prefix=None)
    client = RolloutClient.from_ray("rlep-rollout")

`deploy/ray/serve.yaml` deploys the same application with `serve deploy` (import path
`rlep.services.rollout.ray_app:app_builder`).
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import ray
from pydantic import Field, model_validator
from ray import serve

from rlep.common.config import StrictModel, load_config
from rlep.services.rollout.config import RolloutConfig, port_range_error, port_ranges_overlap_error
from rlep.services.rollout.registry import registry

log = logging.getLogger(__name__)


@serve.deployment(name="rollout", ray_actor_options={"num_cpus": 1}, health_check_period_s=10)
class RolloutReplica:
    def __init__(
        self,
        config: dict[str, Any],
        app_name: str = "rlep-rollout",
        port: int = 0,
        port_slots: int = 1,
        metrics_port: int | None = None,
    ):
        from rlep.services.rollout.replica_port import METRICS_PORT_SETTING, PortClaim, claim_port

        parsed = RolloutConfig.model_validate(config)
        # Reachable from the rest of the cluster unless the config pins a host.
        host = parsed.server.host if parsed.server.host != "127.0.0.1" else bind_address()
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        # Claimed before vLLM loads, so replicas starting together on one node take distinct ports.
        self._port_claim = claim_port(host, port, port_slots)
        update: dict[str, Any] = {"host": host, "port": self._port_claim.port}
        # Without `metrics_port` the config's own `server.metrics_port` stands (`serve deploy` sets one per node).
        self._metrics_claim, metrics_setting = PortClaim(0), "config.server.metrics_port"
        if metrics_port is not None:
            self._metrics_claim = claim_port(host, metrics_port, port_slots, setting=METRICS_PORT_SETTING)
            update["metrics_port"], metrics_setting = self._metrics_claim.port, METRICS_PORT_SETTING
        server = parsed.server.model_copy(update=update)
        from rlep.services.rollout.main import start_rollout  # torch and vLLM: after the cheap checks above

        try:
            self._running = start_rollout(parsed.model_copy(update={"server": server, "replica_id": self._replica_id}))
        except OSError as err:
            # The metrics server binds with Python's socket (errno set); gRPC's bind failure carries no errno.
            if server.metrics_port is None or err.errno != errno.EADDRINUSE:
                raise
            raise OSError(
                err.errno, f"{metrics_setting}: /metrics cannot bind {host}:{server.metrics_port}: {err}"
            ) from err
        self.address = f"{host}:{self._running.port}"
        self.metrics_url = None
        if self._running.metrics_port is not None:
            scheme = "https" if server.tls_cert_file else "http"
            self.metrics_url = f"{scheme}://{host}:{self._running.metrics_port}/metrics"
        self._registry = registry(app_name)
        ray.get(self._registry.register.remote(self._replica_id, self.address, self.metrics_url))
        log.info(
            "rollout replica %s serving on %s, /metrics %s", self._replica_id, self.address, self.metrics_url or "off"
        )

    def get_address(self) -> str:
        return self.address

    def check_health(self) -> None:
        # The worker's watchdog also turns its gRPC health NOT_SERVING; Serve replaces the replica.
        if (reason := self._running.engine.failure) is not None:
            raise RuntimeError(reason)

    def __del__(self) -> None:
        try:
            self._registry.unregister.remote(self._replica_id)
            self._running.stop(grace_s=1.0)
            self._port_claim.release()
            self._metrics_claim.release()
        except Exception:  # noqa: BLE001 - best effort during teardown
            pass


def bind_address() -> str:
    """Where a replica binds: loopback on a one-node cluster (nothing else needs to reach it),
    else the node's IP so other nodes can (never 0.0.0.0)."""
    if len([n for n in ray.nodes() if n.get("Alive")]) <= 1:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


class RolloutAppArgs(StrictModel):
    """Arguments of the rollout Serve application (`serve deploy` args, `app_builder`)."""

    config: dict[str, Any] = {}
    """RolloutConfig fields (services/rollout/config.py), before environment overrides."""
    num_replicas: int = Field(1, ge=1)
    app_name: str = "rlep-rollout"
    """Serve application name; the replica registry is named after it."""
    num_cpus: float = Field(1.0, ge=0)
    """Ray CPUs reserved per replica."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs per replica: its engine's `tensor_parallel_size` on GPU nodes (vLLM runs one worker per GPU), 0 on
    CPUs. Ray gives each replica its own GPUs (CUDA_VISIBLE_DEVICES), so replicas and learner ranks that ask for
    whole GPUs never share one; a replica asking for none would see every GPU and start vLLM on GPU 0."""
    max_per_node: int | None = Field(None, ge=1)
    """At most this many replicas on one Ray node (1: one engine per node/GPU host); None = Serve's choice."""
    port: int = Field(0, ge=0, le=65535)
    """First gRPC port of the replicas on each node; 0 = any free port. A replica serves on the first of
    `port .. port + port_slots - 1` that no other replica of its node claimed (services/rollout/replica_port.py)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """First Prometheus /metrics port of the replicas on each node, taken like `port`; 0 = any free port,
    None = no /metrics."""

    @property
    def port_slots(self) -> int:
        """Ports each node keeps for replicas: one per replica it may hold."""
        return self.max_per_node or self.num_replicas

    @model_validator(mode="after")
    def _ports_fit(self) -> RolloutAppArgs:
        if error := port_range_error(self.port, self.port_slots):
            raise ValueError(f"{error}: lower the port or set max_per_node")
        if self.metrics_port and (error := port_range_error(self.metrics_port, self.port_slots)):
            raise ValueError(f"metrics_port: {error}: lower it or set max_per_node")
        if error := port_ranges_overlap_error(self.port, self.metrics_port, self.port_slots):
            raise ValueError(f"metrics_port: {error}")
        return self


def build_app(
    config: RolloutConfig,
    num_replicas: int = 1,
    app_name: str = "rlep-rollout",
    num_cpus: float = 1.0,
    max_per_node: int | None = None,
    port: int = 0,
    num_gpus: float = 0.0,
    metrics_port: int | None = None,
):
    """A Serve application of `num_replicas` rollout replicas (pass it to `serve.run`); `max_per_node` spreads
    them over the cluster's nodes (1: one engine per node/GPU host), `port` fixes their gRPC ports, `num_gpus` is
    each replica's GPUs, `metrics_port` turns on their /metrics (RolloutAppArgs)."""
    args = RolloutAppArgs(
        num_replicas=num_replicas,
        app_name=app_name,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_per_node=max_per_node,
        port=port,
        metrics_port=metrics_port,
    )
    return _bind(config, args)


def _bind(config: RolloutConfig, args: RolloutAppArgs):
    actor = {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus}
    options: dict[str, Any] = {"num_replicas": args.num_replicas, "ray_actor_options": actor}
    if args.max_per_node is not None:
        options["max_replicas_per_node"] = args.max_per_node
    replica = RolloutReplica.options(**options)
    return replica.bind(
        config.model_dump(mode="json"), args.app_name, args.port, args.port_slots, metrics_port=args.metrics_port
    )


def run_app(app, app_name: str) -> None:
    """`serve.run(app)` whose failure says why: Serve's own error names no cause when replicas fail to start
    (`Failed to update the deployments ['rollout']`), so the last line of the replicas' error is added (a port
    claim that failed names its setting)."""
    try:
        serve.run(app, name=app_name, route_prefix=None)
    except RuntimeError as err:
        deployment = serve.status().applications.get(app_name)
        messages = [d.message for d in deployment.deployments.values()] if deployment else []
        lines = [line.strip() for message in messages for line in message.splitlines() if line.strip()]
        if not lines:
            raise
        raise RuntimeError(f"rollout replicas did not start: {lines[-1]} ({err})") from err


def app_builder(args: dict[str, Any]):
    """Entry point for `serve deploy` / `serve run`: args are `RolloutAppArgs` fields (a bad one: a pydantic error
    naming it)."""
    parsed = RolloutAppArgs.model_validate(args)
    return _bind(load_config(RolloutConfig, parsed.config, env_prefix="rollout"), parsed)
