"""The learner as DeepSpeed processes in Ray actors: `RayPolicy` runs `DeepSpeedPolicy` in N actors (rank 0 is
the rendezvous for gloo/NCCL) and offers the same calls as a local one.

Neither class writes the policy's calls out: both are generated from the `Policy` Protocol
(policy_interface.py), the actor's as forwards to its `DeepSpeedPolicy`, `RayPolicy`'s as calls to every
actor. Ray reads an actor's methods when `ray.remote` is applied, so they are added before it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from rlep.common.ports import free_port
from rlep.services.learner.config import LocalServicesConfig, TrainConfig
from rlep.services.learner.policy_interface import Policy, spread_calls

log = logging.getLogger(__name__)


def _like(name: str, owner: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives a generated method the Protocol's name, docs and signature (Ray checks calls against it).

    A copy of the signature, not `functools.wraps`: Ray adds a tracing parameter to the signature of the
    function that `__wrapped__` leads to, which would be the Protocol's own method.
    """

    def adopt(method: Callable[..., Any]) -> Callable[..., Any]:
        declared = getattr(Policy, name)
        method.__name__, method.__doc__ = name, declared.__doc__
        method.__qualname__ = f"{owner.__qualname__}.{name}"
        method.__module__ = owner.__module__
        method.__signature__ = inspect.signature(declared)
        return method

    return adopt


def _with_forwards(cls: type) -> type:
    """Adds every spread `Policy` call to `cls` as a forward to its `self.policy`."""

    def forward(name: str) -> Callable[..., Any]:
        @_like(name, cls)
        def call(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.policy, name)(*args, **kwargs)

        return call

    for name in spread_calls():
        setattr(cls, name, forward(name))
    return cls


def _with_fan_outs(cls: type) -> type:
    """Adds every spread `Policy` call to `cls` as a call to each of `self.actors`, answering as marked."""

    def fan_out(name: str, rank0_result: bool) -> Callable[..., Any]:
        @_like(name, cls)
        def call(self, *args: Any, **kwargs: Any) -> Any:
            answers = ray.get([getattr(actor, name).remote(*args, **kwargs) for actor in self.actors])
            return answers[0] if rank0_result else None

        return call

    for name, rank0_result in spread_calls().items():
        setattr(cls, name, fan_out(name, rank0_result))
    return cls


@_with_forwards
class PolicyProcess:
    """One learner process. Started in two phases: placed first, then `setup` once rank 0 has named the
    rendezvous (its own node and a port free there: on a cluster it need not be the driver's node).
    Every spread `Policy` call is added by `_with_forwards` as a forward to this process's `DeepSpeedPolicy`."""

    def rendezvous(self) -> tuple[str, int]:
        return self.node_address(), free_port()

    def setup(self, model_dir: str, config: dict, rank: int, world_size: int, master_addr: str, master_port: int):
        from rlep.services.learner.deepspeed_setup import init_distributed
        from rlep.services.learner.policy import DeepSpeedPolicy

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        check_assigned_gpus(ray.get_gpu_ids(), torch.cuda.is_available(), torch.__version__)
        init_distributed(rank, world_size, master_addr, master_port)
        self.policy = DeepSpeedPolicy(Path(model_dir), TrainConfig.model_validate(config), rank, world_size)

    def node_address(self) -> str:
        return ray.util.get_node_ip_address()

    def sender_device(self) -> str:
        return self.policy.sender_device()

    def broadcast_address(self) -> str:
        return self.policy.broadcast_address()


PolicyActor = ray.remote(PolicyProcess)


def check_assigned_gpus(gpu_ids: list, cuda_available: bool, torch_version: str) -> None:
    """Refuses (RuntimeError) a learner process that Ray gave GPUs (`gpu_ids`) and torch cannot use: it would
    train on the CPU without a word (a CPU build of torch, e.g. the CPU image run on a GPU host)."""
    if gpu_ids and not cuda_available:
        raise RuntimeError(
            f"Ray gave this learner process GPU(s) {list(gpu_ids)} but torch {torch_version} sees no CUDA device: "
            "run an image built with rlep[gpu] (deploy/docker/Dockerfile.gpu; RLEP_IMAGE under docker-compose), "
            "or set local.learner_gpus: 0 to train on the CPU"
        )


def learner_gpus(local: LocalServicesConfig, cluster_gpus: float) -> float:
    """Ray GPUs per learner process: `local.learner_gpus`, or 1 when the cluster has GPUs (the driver may run on a
    CPU-only head node), else 0."""
    gpus = local.learner_gpus
    return (1.0 if cluster_gpus > 0 else 0.0) if gpus is None else gpus


def rollout_gpus(local: LocalServicesConfig, cluster_gpus: float) -> float:
    """Ray GPUs per locally started rollout replica: `local.rollout_gpus`, else its engine's tensor-parallel size
    when the cluster has GPUs (vLLM runs one worker per GPU), else 0."""
    if local.rollout_gpus is not None:
        return local.rollout_gpus
    return float(local.rollout_engine.tensor_parallel_size) if cluster_gpus > 0 else 0.0


def check_gpus_fit(
    local: LocalServicesConfig, learner_processes: int, cluster_gpus: float, start_rollout: bool
) -> None:
    """Refuses (ValueError), naming the numbers, a run whose `learner_processes` (`deepspeed.num_processes`) and,
    when started here, rollout replicas need more GPUs than the Ray cluster has: Ray would leave the rest pending
    forever instead of failing. A run that asks for GPUs (set explicitly: the defaults ask for none where the
    cluster has none) on a cluster with none is refused as such: its host or container shows no GPU."""
    demand = {"learner": (learner_processes, learner_gpus(local, cluster_gpus))}
    if start_rollout:
        demand = {"rollout": (local.rollout_replicas, rollout_gpus(local, cluster_gpus)), **demand}
    needed = sum(count * gpus for count, gpus in demand.values())
    if needed > 0 and cluster_gpus == 0:
        asked = [f"local.{name}_gpus={gpus:g}" for name, (_, gpus) in demand.items() if gpus > 0]
        raise ValueError(
            f"{' and '.join(asked)} ask for GPUs, and the Ray cluster has none: no GPU is visible on this host or in "
            "this container. Under docker-compose add `-f docker-compose.gpu.yml` (it reserves the GPUs); "
            "elsewhere check `nvidia-smi` and CUDA_VISIBLE_DEVICES where Ray runs. To train on the CPU, set "
            "local.learner_gpus: 0"
        )
    if needed > cluster_gpus:
        itemised = ", ".join(f"{name} {count} x {gpus:g}" for name, (count, gpus) in demand.items())
        raise ValueError(
            f"this run needs {needed:g} GPUs ({itemised}) and the Ray cluster has {cluster_gpus:g}: lower "
            "local.rollout_replicas or deepspeed.num_processes, or add GPU nodes"
        )


@_with_fan_outs
class RayPolicy(Policy):
    """`DeepSpeedPolicy` over `config.deepspeed.num_processes` Ray actors. The spread `Policy` calls are added by
    `_with_fan_outs`: each goes to every actor and returns rank 0's answer or nothing, as the Protocol marks it."""

    def __init__(self, model_dir: Path, config: TrainConfig):
        world = config.deepspeed.num_processes
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        check_gpus_fit(config.local, config.deepspeed.num_processes, cluster_gpus, start_rollout=False)
        options = {"num_cpus": config.local.learner_cpus, "num_gpus": learner_gpus(config.local, cluster_gpus)}
        if options["num_gpus"] == 0:  # said where the run starts: the actors' own logs stay in Ray's files
            log.info(
                "the learner trains on the CPU (the Ray cluster has %g GPUs, local.learner_gpus=%s)",
                cluster_gpus,
                config.local.learner_gpus,
            )
        self.actors = [PolicyActor.options(**options).remote() for _ in range(world)]
        master, port = ray.get(self.actors[0].rendezvous.remote())
        settings = config.model_dump(mode="json")
        ray.get(
            [a.setup.remote(str(model_dir), settings, rank, world, master, port) for rank, a in enumerate(self.actors)]
        )

    def broadcast_address(self) -> str:
        """Rank 0's host, as the replicas reach it: the weight broadcast group's store listens there. Asked in rank
        0's actor, whose environment is its node's (RLEP_NODE_ADDRESS, e.g. the pod IP), not the driver's."""
        return ray.get(self.actors[0].broadcast_address.remote())

    def sender_device(self) -> str:
        """Rank 0's device type: where the broadcast's sender runs decides its backend."""
        return ray.get(self.actors[0].sender_device.remote())

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
