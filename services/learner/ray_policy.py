"""The learner as DeepSpeed processes in Ray actors: `RayPolicy` runs `DeepSpeedPolicy` in N actors (rank 0 is
the rendezvous for gloo/NCCL) and offers the same calls as a local one."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import ray
import torch

from rlep.services.learner.batch import ExperienceBatch
from rlep.services.learner.config import TrainConfig


@ray.remote
class PolicyActor:
    """One learner process. Started in two phases: placed first, then `setup` once rank 0 has named the
    rendezvous (its own node and a port free there: on a cluster it need not be the driver's node)."""

    def rendezvous(self) -> tuple[str, int]:
        return self.node_address(), free_port()

    def setup(self, model_dir: str, config: dict, rank: int, world_size: int, master_addr: str, master_port: int):
        from rlep.services.learner.policy import DeepSpeedPolicy, init_distributed

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        init_distributed(rank, world_size, master_addr, master_port)
        self.trainer = DeepSpeedPolicy(Path(model_dir), TrainConfig.model_validate(config), rank, world_size)

    # Typed calls, one per `DeepSpeedPolicy` method the learner uses (no method named by a string).
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RayPolicy:
    """`DeepSpeedPolicy` over `config.deepspeed.num_processes` Ray actors; every call goes to all of them."""

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
