"""Weight pushes over NCCL (GPU only): the manifest both sides agree on, and the learner's sending side.

vLLM's RLHF weight-sync pattern: the learner's rank 0 and every rollout worker form a stateless
process group (rank 0 = learner, workers from `rank_offset` on) and the learner broadcasts each
tensor of its state dict in manifest order. The control path stays the gRPC `UpdateWeights` call:
its header carries the version and the manifest's digest, its `nccl_broadcast` chunk the group and
the manifest, so the worker checks names, shapes and dtypes against the model before it receives a
byte, and versions stay atomic with respect to generation as for the other transports.

NOT exercised by CI: our machines have no GPU. What runs here is the manifest logic (unit tests) and
a CPU worker's FAILED_PRECONDITION answer to a broadcast push (integration tests).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rlep.services.weights.payload import TensorInfo

# torch dtype <-> safetensors spelling (what WeightSpec compares).
SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
TORCH_DTYPE = {code: dtype for dtype, code in SAFETENSORS_DTYPE.items()}


@dataclass(frozen=True)
class BroadcastGroup:
    """Where the learner's rank 0 listens and how many ranks join (learner + all receiving workers)."""

    master_address: str
    master_port: int
    world_size: int


def manifest(state_dict: Mapping[str, torch.Tensor]) -> list[tuple[str, TensorInfo]]:
    """(name, dtype and shape) of every tensor, in the order they will be broadcast."""
    out = []
    for name, tensor in state_dict.items():
        if tensor.dtype not in SAFETENSORS_DTYPE:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be broadcast (use float32, bfloat16 or float16)")
        out.append((name, TensorInfo(SAFETENSORS_DTYPE[tensor.dtype], tuple(tensor.shape))))
    return out


def manifest_digest(entries: Sequence[tuple[str, TensorInfo]]) -> str:
    """sha256 of the manifest in a canonical JSON form (what `WeightHeader.sha256` carries for NCCL)."""
    canonical = json.dumps([[name, info.dtype, list(info.shape)] for name, info in entries], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def manifest_bytes(entries: Sequence[tuple[str, TensorInfo]]) -> int:
    return sum(info.nbytes for _, info in entries)


def rank_offsets(replicas: int, workers_per_replica: int) -> list[int]:
    """First group rank of each replica's workers (rank 0 is the learner)."""
    return [1 + i * workers_per_replica for i in range(replicas)]


class NcclWeightSender:
    """The learner's end (rank 0): joins the group once, then broadcasts whole state dicts. GPU only."""

    def __init__(self, group: BroadcastGroup, device: torch.device | None = None):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        if not torch.cuda.is_available():
            raise RuntimeError("NCCL weight broadcast needs a GPU")
        self.group = group
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        store = StatelessProcessGroup.create(
            host=group.master_address, port=group.master_port, rank=0, world_size=group.world_size
        )
        self._communicator = PyNcclCommunicator(store, device=self.device)

    def broadcast(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Sends every tensor in manifest order; the workers receive inside their UpdateWeights call."""
        stream = torch.cuda.current_stream()
        for tensor in state_dict.values():
            self._communicator.broadcast(tensor.to(self.device).contiguous(), src=0, stream=stream)
        stream.synchronize()
