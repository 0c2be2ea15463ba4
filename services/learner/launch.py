"""Running RLEP on Ray: the services a run needs, and the learner as DeepSpeed processes in Ray actors.

`LocalStack` starts what `endpoints` leaves empty — rollout replicas as a Ray Serve deployment,
verifier and replay as Ray actors (the replay one with its embedded Redis) — on the Ray instance
it finds (`ray.init()` locally, or `--ray-address` for a cluster). Services given as addresses
(Kubernetes, a shared deployment) are used as they are.

`RayPolicy` runs `PolicyTrainer` in N actors (rank 0 is the rendezvous for gloo/NCCL) and offers
the same calls as a local one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

import ray
import torch

from rlep_common.files import read_token_file
from services.learner.batch import ExperienceBatch
from services.learner.config import TrainConfig
from services.learner.trainer import Services

log = logging.getLogger(__name__)


# Ray's own switch for "no cluster, this machine only" (its Windows/macOS default). Only with it off does
# Ray keep a loopback node address: otherwise it swaps 127.0.0.1 for the machine's external IP, and its GCS,
# raylet, workers and agents then listen on every interface (measured: 12 of 13 ports on 0.0.0.0, * or the
# external IP per start; 0 with this).
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Joins `address`, or starts a local Ray bound to loopback only (no dashboard; token auth off, as nothing
    off this host can reach it)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    from ray._private import ray_constants

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ[LOOPBACK_ONLY_ENV] = "0"  # for the processes Ray starts
    # Ray read the variable when it was imported: set what it read, for this (driver) process.
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address=LOOPBACK,
    )


@ray.remote(num_cpus=0)
class ServiceActor:
    """Hosts a verifier or replay service (its gRPC server and workers) inside Ray."""

    def __init__(self, kind: str, config: dict[str, Any]):
        from services.rollout.ray_app import bind_address

        host = bind_address()
        config = {**config, "server": {**config.get("server", {}), "host": host, "port": 0}}
        if kind == "verifier":
            from services.verifier.config import VerifierConfig
            from services.verifier.main import start_verifier

            self._running = start_verifier(VerifierConfig.model_validate(config))
        elif kind == "replay":
            from services.replay.config import ReplayConfig
            from services.replay.main import start_replay

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


@ray.remote
class PolicyActor:
    """One learner process. Started in two phases: placed first, then `setup` once rank 0 has named the
    rendezvous (its own node and a port free there: on a cluster it need not be the driver's node)."""

    def rendezvous(self) -> tuple[str, int]:
        return self.node_address(), _free_port()

    def setup(self, model_dir: str, config: dict, rank: int, world_size: int, master_addr: str, master_port: int):
        from services.learner.policy import PolicyTrainer, init_distributed

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        init_distributed(rank, world_size, master_addr, master_port)
        self.trainer = PolicyTrainer(Path(model_dir), TrainConfig.model_validate(config), rank, world_size)

    # Typed calls, one per `PolicyTrainer` method the learner uses (no method named by a string).
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        return self.trainer.logprobs(batch)

    def update(self, batch: ExperienceBatch, rows_per_mini_batch: int) -> dict[str, float]:
        return self.trainer.update(batch, rows_per_mini_batch)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()

    def save_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        self.trainer.save_hf(out_dir, tokenizer_dir)

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        self.trainer.save_checkpoint(directory, tag, client_state)

    def load_checkpoint(self, directory: Path, tag: str | None = None) -> dict[str, Any]:
        return self.trainer.load_checkpoint(directory, tag)

    def rng_state(self) -> dict[str, Any]:
        return self.trainer.rng_state()

    def weight_manifest(self) -> list:
        return self.trainer.weight_manifest()

    def broadcast_weights(self, group) -> None:
        self.trainer.broadcast_weights(group)

    def node_address(self) -> str:
        return ray.util.get_node_ip_address()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RayPolicy:
    """`PolicyTrainer` over `config.deepspeed.num_processes` Ray actors; every call goes to all of them."""

    def __init__(self, model_dir: Path, config: TrainConfig):
        world = config.deepspeed.num_processes
        gpus = config.local.learner_gpus
        gpus = (1.0 if torch.cuda.is_available() else 0.0) if gpus is None else gpus
        options = {"num_cpus": config.local.learner_cpus, "num_gpus": gpus}
        self.actors = [PolicyActor.options(**options).remote() for _ in range(world)]
        master, port = ray.get(self.actors[0].rendezvous.remote())
        settings = config.model_dump(mode="json")
        ray.get(
            [a.setup.remote(str(model_dir), settings, rank, world, master, port) for rank, a in enumerate(self.actors)]
        )

    # Collectives (ZeRO-3 gathers, gradient all-reduce) need every process in every call, so each
    # call goes to all actors; rank 0's answer is the result.
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        return ray.get([a.logprobs.remote(batch) for a in self.actors])[0]

    def update(self, batch: ExperienceBatch, rows_per_mini_batch: int) -> dict[str, float]:
        return ray.get([a.update.remote(batch, rows_per_mini_batch) for a in self.actors])[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return ray.get([a.state_dict.remote() for a in self.actors])[0]

    def save_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        ray.get([a.save_hf.remote(out_dir, tokenizer_dir) for a in self.actors])

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        ray.get([a.save_checkpoint.remote(directory, tag, client_state) for a in self.actors])

    def load_checkpoint(self, directory: Path, tag: str | None = None) -> dict[str, Any]:
        return ray.get([a.load_checkpoint.remote(directory, tag) for a in self.actors])[0]

    def rng_state(self) -> dict[str, Any]:
        return ray.get([a.rng_state.remote() for a in self.actors])[0]

    def weight_manifest(self) -> list:
        return ray.get([a.weight_manifest.remote() for a in self.actors])[0]

    def broadcast_weights(self, group) -> None:
        ray.get([a.broadcast_weights.remote(group) for a in self.actors])

    def broadcast_address(self) -> str:
        """Where rank 0 runs: the NCCL weight group's store listens there."""
        return ray.get(self.actors[0].node_address.remote())

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


class LocalStack:
    """The services of a run: given endpoints are used, missing ones are started on Ray."""

    def __init__(self, config: TrainConfig, model_dir: Path, app_name: str = "rlep-rollout"):
        self.config, self.model_dir, self.app_name = config, model_dir, app_name
        self._actors: dict[str, Any] = {}
        self._serve_started = False
        self.services: Services | None = None
        self.addresses: dict[str, str] = {}
        self.token = read_token_file(config.endpoints.auth_token_file)

    def start(self, need_replay: bool = True) -> Services:
        from services.replay.client import ReplayClient
        from services.rollout.client import RolloutClient
        from services.verifier.client import VerifierClient

        endpoints, local = self.config.endpoints, self.config.local
        auth = {"auth_token_file": str(endpoints.auth_token_file)} if endpoints.auth_token_file else {}
        if endpoints.rollout:
            rollout = RolloutClient(endpoints.rollout, token=self.token)
        else:
            self._start_rollout(auth)
            rollout = RolloutClient.from_ray(self.app_name, token=self.token)  # refresh() follows restarts
        verifier_address = endpoints.verifier or self._start_actor(
            "verifier", {"num_workers": local.verifier_workers, "server": auth}
        )
        verifier = VerifierClient(verifier_address, token=self.token)
        self.addresses["verifier"] = verifier_address
        replay = None
        if need_replay:
            replay_address = endpoints.replay or self._start_actor(
                "replay", {"redis_url": local.replay_redis_url, "server": auth}
            )
            replay = ReplayClient(replay_address, token=self.token)
            self.addresses["replay"] = replay_address
        self.services = Services(rollout=rollout, verifier=verifier, replay=replay)
        return self.services

    def _start_actor(self, kind: str, config: dict) -> str:
        actor = ServiceActor.remote(kind, config)
        self._actors[kind] = actor
        return ray.get(actor.address.remote())

    def _start_rollout(self, auth: dict) -> None:
        from ray import serve

        from services.rollout.config import RolloutConfig
        from services.rollout.ray_app import build_app

        local = self.config.local
        engine = local.rollout_engine.model_copy(update={"model": str(self.model_dir)})
        config = RolloutConfig(engine=engine, server=auth or {})
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
        serve.run(
            build_app(config, local.rollout_replicas, self.app_name, local.rollout_cpus),
            name=self.app_name,
            route_prefix=None,
        )
        self._serve_started = True
        from services.rollout.ray_app import replica_addresses

        replica_addresses(self.app_name, wait_s=600, expect=local.rollout_replicas)

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
