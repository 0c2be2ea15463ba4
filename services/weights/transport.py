"""Weight transports: how one version of the policy's weights becomes the `UpdateWeights` calls of a set of replicas.

A `WeightTransport` turns the weights and a version into a `WeightPush`: one message stream per target replica
and, for a broadcast, the broadcast to run once those calls are started. The caller (`RolloutClient.push_weights`) owns
the replicas, their stubs and what happens when one is down; a transport knows only addresses and messages.

- `StreamTransport`: the safetensors payload in chunks over gRPC, read from the tensors' memory (any host).
- `SharedFileTransport`: one payload file in this host's shared memory, named in the call (local replicas only).
- `AutoTransport`: shared_file when every replica is on this host, else stream.
- `BroadcastTransport`: the calls carry the manifest and the learner's rank 0 broadcasts the tensors over NCCL
  (GPUs, NOT exercised by CI) or gloo (any device; CI runs it), services/weights/broadcast.py.

`setup_weight_transport` builds one from a training run's `weight_sync` config (config.py).
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from rlep.common.errors import UserError
from rlep.rollout.v1 import rollout_pb2
from rlep.services.weights.address import NODE_ADDRESS_ENV, is_loopback
from rlep.services.weights.broadcast import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    BroadcastGroup,
    manifest_bytes,
    manifest_digest,
    rank_offsets,
    replica_workers,
)
from rlep.services.weights.config import (
    AutoSyncConfig,
    NcclSyncConfig,
    SharedFileSyncConfig,
    StreamSyncConfig,
    WeightSyncConfig,
)
from rlep.services.weights.payload import (
    DIGEST_ALGORITHMS,
    PAYLOAD_DIGEST,
    Payload,
    TensorInfo,
    payload_of,
    write_payload,
)
from rlep.services.weights.staging import PUSH_PREFIX, default_staging_dir, staged_file
from rlep.services.weights.wire import DataChunk

BACKEND_TO_PROTO = {"nccl": rollout_pb2.NCCL, "gloo": rollout_pb2.GLOO}
# Streamed payload slices: far below gRPC's message limit, large enough that per-message cost is negligible
# (416 MB over loopback took 0.40-0.56 s with any size from 512 KiB to 4 MiB; 64 KiB took 1.2 s).
CHUNK_BYTES = 4 * 1024 * 1024

# The tensors to push (checkpoint names), or a function giving them. Transports that carry the tensors call it
# once; the broadcast transport never does (its sender reads them on the learner's devices, so nothing is copied here).
StateDictSource = Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]
# Each replica's vLLM workers as it reports them (GetStatus `workers`, 0 when it does not), in the order of the
# addresses asked about: the caller, which holds the replicas' stubs, asks them (`RolloutClient.reported_workers`).
ReportedWorkers = Callable[[Sequence[str]], Sequence[int]]


@dataclass(frozen=True)
class WeightPush:
    """One version's UpdateWeights calls, ready to start."""

    requests: list[Iterator[rollout_pb2.WeightChunk | DataChunk]]
    """The message stream of each target replica, in the targets' order."""
    after_start: Callable[[], None] = lambda: None
    """Runs once every call has started (broadcast: the learner's broadcast, which the workers receive inside them)."""
    all_replicas: bool = False
    """Every replica must take part (a fixed-size broadcast group): one that is down fails the push instead of being
    left out until it is back."""


class WeightTransport(ABC):
    """How a push's weights travel; one instance serves every push of a run (a broadcast keeps its groups in it)."""

    @abstractmethod
    def prepare(
        self, weights: StateDictSource, version: int, addresses: Sequence[str]
    ) -> AbstractContextManager[WeightPush]:
        """The calls that bring the replicas at `addresses` to `version`; what they need lives until the block ends."""


def read_state_dict(weights: StateDictSource) -> dict[str, torch.Tensor]:
    return dict(weights() if callable(weights) else weights)


def payload_header(version: int, digest: str, total_bytes: int) -> rollout_pb2.WeightHeader:
    """The header of a safetensors payload whose `PAYLOAD_DIGEST` is `digest`."""
    return rollout_pb2.WeightHeader(
        version=version,
        digest_algorithm=DIGEST_ALGORITHMS[PAYLOAD_DIGEST],
        digest=digest,
        total_bytes=total_bytes,
        format=rollout_pb2.SAFETENSORS,
    )


class StreamTransport(WeightTransport):
    """The safetensors payload streamed straight from the tensors' memory: no file on the sending side."""

    @contextmanager
    def prepare(self, weights: StateDictSource, version: int, addresses: Sequence[str]) -> Iterator[WeightPush]:
        payload = payload_of(read_state_dict(weights))
        header = payload_header(version, payload.digest(), payload.nbytes)
        yield WeightPush([stream_payload(header, payload) for _ in addresses])


class SharedFileTransport(WeightTransport):
    """One payload file in this host's shared memory, named in every call."""

    @contextmanager
    def prepare(self, weights: StateDictSource, version: int, addresses: Sequence[str]) -> Iterator[WeightPush]:
        # Locked while it exists, so a worker starting on this host removes it if this process dies first.
        with staged_file(default_staging_dir(), PUSH_PREFIX) as (_, path):
            digest = write_payload(read_state_dict(weights), path)
            header = payload_header(version, digest, path.stat().st_size)
            yield WeightPush([iter(shared_file_messages(header, path)) for _ in addresses])


class AutoTransport(WeightTransport):
    """shared_file when every replica is on this host, else stream."""

    def resolve(self, addresses: Sequence[str]) -> StreamTransport | SharedFileTransport:
        return SharedFileTransport() if all(is_local(a) for a in addresses) else StreamTransport()

    def prepare(
        self, weights: StateDictSource, version: int, addresses: Sequence[str]
    ) -> AbstractContextManager[WeightPush]:
        return self.resolve(addresses).prepare(weights, version, addresses)


class BroadcastSender(Protocol):
    """The learner's side of a broadcast push (its policy: rank 0 sends, every rank takes part)."""

    def weight_manifest(self) -> list[tuple[str, TensorInfo]]: ...
    def broadcast_weights(self, group: BroadcastGroup) -> None: ...
    def broadcast_address(self) -> str: ...
    def sender_device(self) -> str: ...


class BroadcastTransport(WeightTransport):
    """Every replica's workers receive the tensors from the learner's rank 0 over `backend` (nccl or gloo).

    Each call carries the manifest (checked by the worker before it joins) and the replica's ranks in the group;
    the broadcast then runs from `sender`. A group's size is fixed, so every replica must take part. A group is
    kept while its pushes succeed; after a failed push the next one forms a new group on the next port. Each
    replica takes as many ranks as it reports workers (`reported_workers`, asked when a group is formed);
    `workers_per_replica`, when set, must agree, and counts for a replica that does not say (else `assumed_workers`).
    The group's address is `master_address`, else the sender's; a loopback one is refused when a replica is elsewhere.
    """

    def __init__(
        self,
        sender: BroadcastSender,
        first_port: int,
        workers_per_replica: int | None = None,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reported_workers: ReportedWorkers | None = None,
        assumed_workers: int = 1,
        master_address: str | None = None,
    ):
        self.sender, self.workers_per_replica = sender, workers_per_replica
        self.master_address = master_address  # None: where the sender says its rank 0 is
        self.backend, self.timeout_s, self.bucket_bytes = backend, timeout_s, bucket_bytes
        self.reported_workers = reported_workers or (lambda addresses: [0] * len(addresses))
        self.assumed_workers = workers_per_replica or assumed_workers
        self._next_port = first_port
        self._groups: dict[tuple[str, ...], BroadcastGroup] = {}
        self._offsets: dict[tuple[str, ...], list[int]] = {}  # each replica's first rank in its set's group
        self._manifest: list[tuple[str, TensorInfo]] | None = None  # tensor names, dtypes, shapes (fixed for a run)

    def group(self, addresses: Sequence[str]) -> BroadcastGroup:
        """One group per set of replicas, each on its own port."""
        key = tuple(addresses)
        if key not in self._groups:
            reported = self.reported_workers(key)
            workers = replica_workers(key, reported, self.workers_per_replica, self.assumed_workers)
            self._offsets[key], size = rank_offsets(workers), 1 + sum(workers)
            address = self.master_address or self.sender.broadcast_address()
            check_group_address(address, key)
            self._groups[key] = BroadcastGroup(address, self._next_port, size, self.backend, self.timeout_s)
            self._next_port += 1
        return self._groups[key]

    @contextmanager
    def prepare(self, weights: StateDictSource, version: int, addresses: Sequence[str]) -> Iterator[WeightPush]:
        group = self.group(addresses)
        self._manifest = self._manifest or self.sender.weight_manifest()
        offsets = self._offsets[tuple(addresses)]
        requests = [
            iter(broadcast_messages(version, self._manifest, group, offset, self.bucket_bytes)) for offset in offsets
        ]
        try:
            yield WeightPush(requests, after_start=lambda: self.sender.broadcast_weights(group), all_replicas=True)
        except BaseException:
            # Some rank may have left the group (a failed or dead peer closes it): never reuse it.
            self._groups.pop(tuple(addresses), None)
            raise


def resolve_backend(backend: str, sender_device: str) -> str:
    """`auto` is nccl when the sender (the learner's rank 0) runs on CUDA, else gloo. Decided where rank 0 runs, not
    where this process does: the driver may be a CPU-only head node of a GPU cluster."""
    if backend != "auto":
        return backend
    return "nccl" if sender_device == "cuda" else "gloo"


def setup_weight_transport(
    config: WeightSyncConfig,
    sender: BroadcastSender | None = None,
    tensor_parallel_size: int = 1,
    reported_workers: ReportedWorkers | None = None,
) -> WeightTransport:
    """The transport `config` names; `sender` (the learner's policy) is needed by the broadcast only. The broadcast
    gives each replica the ranks of the workers it reports (`reported_workers`); a replica that does not say counts
    as the config's `workers_per_replica`, else as `tensor_parallel_size` (the learner's own engine config)."""
    match config:
        case AutoSyncConfig():
            return AutoTransport()
        case StreamSyncConfig():
            return StreamTransport()
        case SharedFileSyncConfig():
            return SharedFileTransport()
        case NcclSyncConfig() if sender is not None:
            backend = resolve_backend(config.backend, sender.sender_device())
            bucket_bytes = int(config.bucket_mb * 2**20)
            return BroadcastTransport(
                sender,
                config.nccl_port,
                config.workers_per_replica,
                backend,
                config.timeout_s,
                bucket_bytes,
                reported_workers,
                assumed_workers=tensor_parallel_size,
                master_address=None if config.master_address == "auto" else config.master_address,
            )
    raise ValueError(f"weight_sync.transport {config.transport} needs the learner's policy as its sender")


def is_local(address: str) -> bool:
    """Whether a `host:port` address is on this host (so it can read this host's shared memory)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if is_loopback(host):
        return True
    try:
        return host in {socket.gethostbyname(socket.gethostname()), socket.getfqdn()}
    except OSError:
        return False


def check_group_address(address: str, replicas: Sequence[str]) -> None:
    """Refuses (UserError, naming both) a group at a loopback `address` when a replica is not on this host: its
    workers would look for the learner's store at their own loopback and the push fail after the join timeout."""
    remote = [replica for replica in replicas if not is_local(replica)]
    if is_loopback(address) and remote:
        raise UserError(
            f"the weight broadcast's group address {address} is loopback, but rollout replicas {remote} are on other "
            f"hosts: they cannot reach it. Set weight_sync.master_address to an address of the learner's rank-0 host "
            f"that they reach, or {NODE_ADDRESS_ENV} there (the Helm chart sets it to the pod IP)"
        )


def shared_file_messages(header: rollout_pb2.WeightHeader, path: str | Path) -> list[rollout_pb2.WeightChunk]:
    return [rollout_pb2.WeightChunk(header=header), rollout_pb2.WeightChunk(shared_file=str(path))]


def stream_payload(
    header: rollout_pb2.WeightHeader, payload: Payload | bytes
) -> Iterator[rollout_pb2.WeightChunk | DataChunk]:
    """The header, then views of the payload's bytes in chunks of at most CHUNK_BYTES, for a call whose request
    serializer is `encode_chunk` (services/weights/wire.py: one copy each, into the message's wire bytes)."""
    yield rollout_pb2.WeightChunk(header=header)
    if not isinstance(payload, Payload):
        payload = Payload(b"", [memoryview(payload)])
    for block in payload.blocks(CHUNK_BYTES):
        yield DataChunk(block)


def broadcast_messages(
    version: int,
    entries: Sequence[tuple[str, TensorInfo]],
    group: BroadcastGroup,
    rank_offset: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> list[rollout_pb2.WeightChunk]:
    """One replica's call of a broadcast push: the header (manifest digest and size), then its place in `group`."""
    header = rollout_pb2.WeightHeader(
        version=version,
        sha256=manifest_digest(entries),
        total_bytes=manifest_bytes(entries),
        format=rollout_pb2.SAFETENSORS,
    )
    chunk = rollout_pb2.NcclBroadcast(
        master_address=group.master_address,
        master_port=group.master_port,
        rank_offset=rank_offset,
        world_size=group.world_size,
        tensors=[rollout_pb2.TensorSpec(name=n, dtype=i.dtype, shape=list(i.shape)) for n, i in entries],
        backend=BACKEND_TO_PROTO[group.backend],
        timeout_s=group.timeout_s,
        bucket_bytes=bucket_bytes,
    )
    return [rollout_pb2.WeightChunk(header=header), rollout_pb2.WeightChunk(nccl_broadcast=chunk)]
