"""How each step's new weights reach the rollout replicas (`weight_sync` of a training run): one variant per
transport, told apart by the `transport` field; `setup_weight_transport` (transport.py) builds the transport.

Here rather than in the learner's config because the factory that reads it sits in this layer, below the learner.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from rlep.common.config import StrictModel


class AutoSyncConfig(StrictModel):
    transport: Literal["auto"] = "auto"
    """One shared-memory file when every replica is on this host, else safetensors streamed over gRPC."""


class StreamSyncConfig(StrictModel):
    transport: Literal["stream"] = "stream"
    """The safetensors payload streamed over gRPC in chunks: reaches replicas on any host."""


class SharedFileSyncConfig(StrictModel):
    transport: Literal["shared_file"] = "shared_file"
    """One safetensors file in this host's shared memory, named in the call: replicas on this host only."""


class NcclSyncConfig(StrictModel):
    transport: Literal["nccl"] = "nccl"
    """The learner's rank 0 broadcasts every tensor to every replica's workers through a process group of their
    own (vLLM's RLHF pattern; services/weights/broadcast.py). Every replica takes part in every push."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """The group's communicator: `nccl` between GPUs (NOT exercised by CI), `gloo` over TCP on any device (what CI
    runs), `auto` = nccl when the learner's rank 0 runs on CUDA, else gloo."""
    nccl_port: int = Field(29650, ge=1024, le=65000)
    """First port of the group's store on the learner's rank 0 (a new group takes the next one)."""
    master_address: str = Field("auto", pattern=r"^\S+$")
    """Where the group's store listens, as every replica's workers reach it: an IP or a name of the host of the
    learner's rank 0. `auto`: RLEP_NODE_ADDRESS on that host when set (the Helm chart sets the pod IP, compose the
    container's address), else Ray's node IP there, which is 127.0.0.1 under the Ray `rlep train` starts without
    `--ray-address` (services/weights/address.py). A loopback address is refused when a replica is on another host."""
    workers_per_replica: int | None = Field(None, ge=1)
    """vLLM workers per rollout replica, each one rank of the group (each loads its own shard of every full tensor).
    Each replica reports its own (GetStatus `workers`, its tensor-parallel size) and the group follows that, so
    replicas of different sizes can share it; set, this is checked against every replica (a push to one reporting
    another number is refused) and counts for a replica too old to report. None: what each replica reports, and
    `local.rollout_engine.tensor_parallel_size` for one that does not."""
    timeout_s: float = Field(60.0, gt=0, le=3600)
    """Bound on every rank's join and on each bucket: a peer that died or never came fails the push within it
    (gloo fails at once when a peer's connection closes). Covers a worker finishing its generation batch first."""
    bucket_mb: float = Field(512.0, gt=0, le=65536)
    """MiB of tensors a rollout worker receives before loading them into its model: the push's memory beyond the
    model on each worker (plus one layer vLLM buffers). A model no larger than one bucket is replaced atomically;
    a larger one's push that fails after its first bucket retires the replica (it restarts on its start weights)."""


def _transport_of(value: Any) -> str:
    # A section that names no transport is `auto`, the default, as it was before the variants existed.
    if isinstance(value, dict):
        return value.get("transport", "auto")
    return getattr(value, "transport", "auto")


WeightSyncConfig = Annotated[
    Annotated[AutoSyncConfig, Tag("auto")]
    | Annotated[StreamSyncConfig, Tag("stream")]
    | Annotated[SharedFileSyncConfig, Tag("shared_file")]
    | Annotated[NcclSyncConfig, Tag("nccl")],
    Discriminator(_transport_of),
]
