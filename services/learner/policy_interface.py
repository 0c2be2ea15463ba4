"""The one declaration of what the learner asks of its policy: the `Policy` Protocol, and for each call how it
reaches a policy spread over processes.

`DeepSpeedPolicy` (policy.py) implements it in one process. `ray_policy.py` generates from this Protocol the
Ray actor's forwarding methods and `RayPolicy`'s fan-out methods (`spread_calls`), so a call added here
reaches every implementation without being written again. Call sites stay typed: `policy.update(batch, n)`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from rlep.services.learner.batch import ExperienceBatch
from rlep.services.rollout.client import PushResult, ReplicaTarget
from rlep.services.weights.broadcast import BroadcastGroup
from rlep.services.weights.config import WeightSyncConfig
from rlep.services.weights.payload import TensorInfo

__all__ = ["Policy", "spread_calls"]

Method = TypeVar("Method", bound=Callable[..., Any])
_RANK0_MARK = "__rlep_rank0_result__"  # attribute marking a Protocol method as spread over processes


def _on_all_ranks(rank0_result: bool) -> Callable[[Method], Method]:
    # Collectives (ZeRO-3 gathers, gradient all-reduce, the NCCL weight broadcast) need every process in
    # every call, so a spread policy sends each call to all ranks; the marker says whether rank 0's answer
    # is the call's result or the call returns nothing.
    def mark(method: Method) -> Method:
        setattr(method, _RANK0_MARK, rank0_result)
        return method

    return mark


returns_rank0 = _on_all_ranks(True)
"""All ranks run the call; rank 0's answer is its result."""
returns_nothing = _on_all_ranks(False)
"""All ranks run the call; it returns nothing."""


class Policy(Protocol):
    @returns_rank0
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor: ...
    @returns_rank0
    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor: ...
    @returns_rank0
    def logprobs_with_processed(
        self, batch: ExperienceBatch, temperature: float, top_p: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    @returns_rank0
    def update(self, batch: ExperienceBatch, rows_per_mini_batch: int) -> dict[str, float]: ...
    @returns_rank0
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    @returns_rank0
    def push_weights(self, target: ReplicaTarget, version: int, sync: WeightSyncConfig) -> PushResult | None: ...
    @returns_nothing
    def save_hf(self, out_dir: Path, tokenizer_dir: Path) -> None: ...
    @returns_nothing
    def save_checkpoint(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None: ...
    @returns_rank0
    def load_checkpoint(self, directory: Path, tag: str | None = None) -> dict[str, Any]: ...
    @returns_rank0
    def rng_state(self) -> dict[str, Any]: ...

    # Weight broadcast (weight_sync.transport = nccl; NCCL or gloo).
    @returns_rank0
    def weight_manifest(self) -> list[tuple[str, TensorInfo]]: ...
    @returns_nothing
    def broadcast_weights(self, group: BroadcastGroup) -> None: ...
    # Where rank 0 runs (the NCCL group's store listens there) and on what device (`auto` picks NCCL for CUDA):
    # asked of rank 0 alone, so not spread.
    def broadcast_address(self) -> str: ...
    def sender_device(self) -> str: ...


def spread_calls() -> dict[str, bool]:
    """Name -> whether rank 0's answer is the result, for every `Policy` call that goes to all ranks."""
    return {
        name: getattr(method, _RANK0_MARK)
        for name, method in vars(Policy).items()
        if callable(method) and hasattr(method, _RANK0_MARK)
    }
