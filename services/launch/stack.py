"""The services a run needs: `ServiceStack` starts what `endpoints` leaves empty — rollout replicas as a Ray
Serve deployment, verifier and replay as Ray actors (the replay one with its embedded Redis) — on the Ray
instance it finds (`ray.init()` locally, or `--ray-address` for a cluster). Services given as addresses
(Kubernetes, a shared deployment) are used as they are.

With `local.rollout_metrics_port` set, each replica started here also serves the `rlep_rollout_*` series on
Prometheus /metrics; `rollout_metrics_urls()` says where (one log line per replica at start says the same).

Replicas started here serve `model_dir` as the policy version it records (`rlep-policy.json`, written beside a
trained checkpoint's HF export; 0 for a base model), so a rollout started from a trained checkpoint reports that
checkpoint's version, and a replica Ray Serve restarts comes back at it.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlep.common.errors import UserError
from rlep.common.files import read_token_file
from rlep.common.policy_info import policy_version_of
from rlep.common.ports import free_port
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.ray_policy import check_gpus_fit, rollout_gpus
from rlep.services.learner.step_inputs import ServiceClients
from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.sandbox import Sandbox

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class ServiceActor:
    """Hosts a verifier or replay service (its gRPC server and workers) inside Ray."""

    def __init__(self, kind: str, config: dict[str, Any]):
        from rlep.services.rollout.ray_app import bind_address

        host = bind_address()
        config = {**config, "server": {**config.get("server", {}), "host": host, "port": 0}}
        if kind == "verifier":
            from rlep.services.verifier.config import VerifierConfig
            from rlep.services.verifier.main import start_verifier

            self._running = start_verifier(VerifierConfig.model_validate(config))
        elif kind == "replay":
            from rlep.services.replay.config import ReplayConfig
            from rlep.services.replay.main import start_replay

            self._running = start_replay(ReplayConfig.model_validate(config))
        else:
            raise ValueError(f"unknown service {kind!r}")
        self._address = f"{host}:{self._running.port}"

    def address(self) -> str:
        return self._address

    def pids(self) -> list[int]:
        """Worker process ids (the verifier's pool), for fault tests."""
        pool = getattr(self._running, "pool", None)
        return list(pool.worker_pids) if pool is not None else []

    def stop(self) -> None:
        self._running.stop()


def check_same_sandbox(mine: SandboxConfig, service: dict, address: str) -> None:
    """A run's traces carry a hash of its own `tools.sandbox` settings (`tool_env_hash`): a sandbox service whose
    outputs depend on other settings would make every stored trace lie about where its outputs came from."""
    ours = mine.environment()
    differ = sorted(k for k in ours.keys() | service.keys() if ours.get(k) != service.get(k))
    if differ:
        details = "; ".join(f"{k}: this run {ours.get(k)!r}, the service {service.get(k)!r}" for k in differ)
        raise UserError(
            f"the sandbox service at {address} runs tool code under other settings than this run's tools.sandbox "
            f"({details}): set tools.sandbox to the service's, so the traces' tool_env_hash says where their outputs "
            "came from"
        )


class ServiceStack:
    """The services of a run: given endpoints are used, missing ones are started on Ray."""

    def __init__(self, config: TrainConfig, model_dir: Path, app_name: str = "rlep-rollout"):
        self.config, self.model_dir, self.app_name = config, model_dir, app_name
        self._actors: dict[str, Any] = {}
        self._serve_started = False
        self.services: ServiceClients | None = None
        self.addresses: dict[str, str] = {}
        self.token = read_token_file(config.endpoints.auth_token_file)

    def start(self, need_replay: bool = True) -> ServiceClients:
        from rlep.services.replay.client import ReplayClient
        from rlep.services.rollout.client import RolloutClient
        from rlep.services.sandbox.client import SandboxClient
        from rlep.services.verifier.client import VerifierClient

        endpoints, local = self.config.endpoints, self.config.local
        auth = {"auth_token_file": str(endpoints.auth_token_file)} if endpoints.auth_token_file else {}
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        start_rollout = not (endpoints.rollout or endpoints.rollout_service)
        try:
            check_gpus_fit(local, self.config.deepspeed.num_processes, cluster_gpus, start_rollout)
        except ValueError as err:
            raise UserError(str(err)) from None
        options = {"token": self.token, "generate_deadline": endpoints.generate_deadline}
        if endpoints.rollout:
            rollout = RolloutClient(endpoints.rollout, **options)
        elif endpoints.rollout_service:
            rollout = RolloutClient.from_service(endpoints.rollout_service, **options)  # re-resolved per step
        else:
            self._start_rollout(auth, rollout_gpus(local, cluster_gpus))
            rollout = RolloutClient.from_ray(self.app_name, **options)  # refresh() follows restarts
        verifier_address = endpoints.verifier or self._start_actor(
            "verifier",
            {"num_workers": local.verifier_workers, "server": auth, **self.config.verifier.model_dump(mode="json")},
        )
        verifier = VerifierClient(verifier_address, token=self.token, outage_s=endpoints.service_outage_s)
        self.addresses["verifier"] = verifier_address
        replay = None
        if need_replay:
            replay_address = endpoints.replay or self._start_actor(
                "replay",
                {"redis_url": local.replay_redis_url, "local_redis_dir": str(local.replay_redis_dir), "server": auth},
            )
            replay = ReplayClient(replay_address, token=self.token, outage_s=endpoints.service_outage_s)
            self.addresses["replay"] = replay_address
        run_code = None
        if self.config.tools is not None and endpoints.sandbox:  # a sandbox service: tool code runs there
            sandbox = SandboxClient(endpoints.sandbox, token=self.token, outage_s=endpoints.service_outage_s)
            check_same_sandbox(self.config.tools.sandbox, sandbox.describe(), endpoints.sandbox)
            run_code, self.addresses["sandbox"] = sandbox.run, endpoints.sandbox
        elif self.config.tools is not None:  # here, in the driver's process, under the sandbox's namespaces
            run_code = Sandbox(self.config.tools.sandbox).run
        self.services = ServiceClients(rollout=rollout, verifier=verifier, replay=replay, run_code=run_code)
        return self.services

    def _start_actor(self, kind: str, config: dict) -> str:
        # On this (the driver's) node: a cluster that loses a worker node keeps its verifier and its replay pool
        # (whose embedded Redis keeps its files on this machine).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = ServiceActor.options(scheduling_strategy=here).remote(kind, config)
        self._actors[kind] = actor
        return ray.get(actor.address.remote())

    def _start_rollout(self, auth: dict, gpus_per_replica: float) -> None:
        from ray import serve

        from rlep.services.rollout.config import RolloutConfig
        from rlep.services.rollout.ray_app import build_app, run_app

        local = self.config.local
        # The replicas return the logprobs the learner compares theirs with (`algorithm.logprobs_mode`).
        engine = local.rollout_engine.model_copy(
            update={"model": str(self.model_dir), "logprobs_mode": self.config.algorithm.logprobs_mode}
        )
        config = RolloutConfig(engine=engine, server=auth or {}, initial_version=policy_version_of(self.model_dir))
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        run_app(
            build_app(
                config,
                local.rollout_replicas,
                self.app_name,
                local.rollout_cpus,
                local.rollout_max_per_node,
                local.rollout_port,
                gpus_per_replica,
                local.rollout_metrics_port,
            ),
            self.app_name,
        )
        self._serve_started = True
        from rlep.services.rollout.registry import replica_addresses

        replica_addresses(self.app_name, wait_s=600, expect=local.rollout_replicas)
        if local.rollout_metrics_port is not None:
            for address, url in sorted(self.rollout_metrics_urls().items()):
                log.info("rollout replica %s: /metrics at %s", address, url)

    def rollout_metrics_urls(self) -> dict[str, str]:
        """gRPC address -> /metrics URL of each live replica this stack started (`local.rollout_metrics_port`;
        read from the replica registry, so a replica Serve restarted shows its new address); {} when it started
        none or they serve no /metrics."""
        if not self._serve_started:
            return {}
        from rlep.services.rollout.registry import replica_metrics_urls

        return replica_metrics_urls(self.app_name)

    def actor(self, kind: str):
        """The Ray actor hosting a service this stack started ("verifier" or "replay"), if any."""
        return self._actors.get(kind)

    def close(self) -> None:
        for actor in self._actors.values():
            with contextlib.suppress(Exception):  # shutting down anyway
                ray.get(actor.stop.remote(), timeout=30)
            ray.kill(actor)
        self._actors = {}
        if self._serve_started:
            from ray import serve

            serve.delete(self.app_name)
            self._serve_started = False
