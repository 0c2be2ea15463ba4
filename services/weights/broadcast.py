"""Weight pushes by collective broadcast: the manifest both sides agree on, the communicators, and both ends.

vLLM's RLHF weight-sync pattern: the learner's rank 0 and every rollout worker form a stateless
process group (rank 0 = learner, workers from `rank_offset` on) and the learner broadcasts each
tensor of its state dict in manifest order. The control path stays the gRPC `UpdateWeights` call:
its header carries the version and the manifest's digest, its `nccl_broadcast` chunk the group and
the manifest, so the worker checks names, shapes and dtypes against the model before it receives a
byte, and versions stay atomic with respect to generation as for the other transports.

The group's `backend` picks the communicator; everything else is the same code:
- `nccl`: vLLM's PyNcclCommunicator over its StatelessProcessGroup (GPUs). NOT exercised by CI.
- `gloo`: a torch ProcessGroupGloo on its own TCPStore (any device, tensors go through host memory);
  CI runs the whole path with it against a real vLLM CPU worker (tests/integration/test_weights_broadcast.py).
Neither touches torch.distributed's default group, so DeepSpeed's group in the learner and vLLM's in the
worker are left alone.

Receiving workers load the tensors as they arrive, a bucket at a time (`receive_buckets`): the extra memory a push
takes on a worker is one bucket plus what vLLM's layerwise reload buffers for a layer not yet complete, never a
second copy of the model (docs/scaling.md has the arithmetic at 7B). The first bucket is received before loading
starts, so a push that fails within it leaves the previous weights serving; a failure later leaves a model part old,
part new, and the replica retires (services/rollout/engine.py).

Failures are bounded: every `synchronize` (one per bucket, on both ends) waits at most `timeout_s`; gloo also fails a
tensor after `timeout_s`, and at once when a peer's socket closes (a peer process died). A join fails after
`timeout_s` once rank 0's store is up, but a worker whose rank 0 never comes waits out TCPStore's connect retries,
measured at ~3x `timeout_s`. An NCCL collective that times out leaves work queued on the GPU that only ending the
process frees: the communicator says so (`wedged`) and the replica retires. A closed communicator is destroyed
(NCCL: `ncclCommAbort`, its GPU buffers freed) and never reused: the next push builds a new group on a new port.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlep.common.errors import UserError
from rlep.services.weights.payload import TensorInfo

log = logging.getLogger(__name__)

# torch dtype <-> safetensors spelling (what WeightSpec compares).
SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
TORCH_DTYPE = {code: dtype for dtype, code in SAFETENSORS_DTYPE.items()}
BACKENDS = ("nccl", "gloo")
# A join waits for every rank, and a worker joins only once its engine finishes the batch it is generating:
# long enough for a batch of long samples on a slow CPU, short enough that a dead peer is reported promptly.
DEFAULT_TIMEOUT_S = 60.0
# Tensors received before each load (and sent between two waits for completion): 512 MiB, verl's default bucket.
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
_STORE_PREFIX = "rlep-weights"  # keys of our group in its store, apart from anything else using the port


@dataclass(frozen=True)
class BroadcastGroup:
    """Where the learner's rank 0 listens, how many ranks join (learner + all receiving workers), and how."""

    master_address: str
    master_port: int
    world_size: int
    backend: str = "nccl"
    """`nccl` (GPUs) or `gloo` (TCP, any device)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Bound on joining the group and on each bucket; a peer that died fails it sooner."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"broadcast backend must be one of {BACKENDS}, got {self.backend!r}")


def manifest(state_dict: Mapping[str, torch.Tensor]) -> list[tuple[str, TensorInfo]]:
    """(name, dtype and shape) of every tensor, in the order they will be broadcast."""
    out = []
    for name, tensor in state_dict.items():
        if tensor.dtype not in SAFETENSORS_DTYPE:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be broadcast (use float32, bfloat16 or float16)")
        out.append((name, TensorInfo(SAFETENSORS_DTYPE[tensor.dtype], tuple(tensor.shape))))
    return out


def manifest_digest(entries: Sequence[tuple[str, TensorInfo]]) -> str:
    """sha256 of the manifest in a canonical JSON form (what `WeightHeader.sha256` carries for a broadcast)."""
    canonical = json.dumps([[name, info.dtype, list(info.shape)] for name, info in entries], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def manifest_bytes(entries: Sequence[tuple[str, TensorInfo]]) -> int:
    return sum(info.nbytes for _, info in entries)


def rank_offsets(workers: Sequence[int]) -> list[int]:
    """First group rank of each replica's workers, given each replica's number of workers (rank 0 is the learner)."""
    return [1 + sum(workers[:i]) for i in range(len(workers))]


def replica_workers(
    addresses: Sequence[str], reported: Sequence[int], configured: int | None, assumed: int
) -> list[int]:
    """Each replica's ranks in a broadcast group: the vLLM workers it reports (GetStatus `workers`), so replicas of
    different tensor-parallel sizes share one group (world size 1 + the sum).

    Args:
        addresses: the replicas (named in messages).
        reported: what each replica says, 0 when it does not (an older server).
        configured: `weight_sync.workers_per_replica`, None when unset.
        assumed: what a replica that does not say counts as (`configured`, else the learner's
            `local.rollout_engine.tensor_parallel_size`).
    Returns: the workers of each replica, in the order of `addresses`.
    Raises UserError when `configured` is set and a replica reports another number: a group built from the wrong one
    fails only after its join timeout, inside vLLM (`assert rank < world_size`).
    """
    out = []
    for address, count in zip(addresses, reported, strict=True):
        if count and configured is not None and count != configured:
            raise UserError(
                f"weight_sync.workers_per_replica={configured} but rollout replica {address} reports {count} vLLM "
                "workers (its tensor_parallel_size): leave workers_per_replica unset, and the group follows what "
                "each replica reports"
            )
        if not count:
            log.warning(
                "rollout replica %s does not report its vLLM workers (a server older than GetStatus `workers`): "
                "counting %d (weight_sync.workers_per_replica, else local.rollout_engine.tensor_parallel_size)",
                address,
                assumed,
            )
        out.append(count or assumed)
    return out


class CollectiveTimeout(RuntimeError):
    """A broadcast did not complete within the group's `timeout_s`: a peer died or hangs."""


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Polls `done` (a CUDA event's `query`) until it holds or `timeout_s` passes; False on timeout.

    NCCL has no timeout of its own: a broadcast whose peer died spins on the GPU for ever, and a blocking
    `synchronize` would hang the caller with it. Polling from 1 ms, backing off to 20 ms, costs no more than that.
    """
    deadline, pause = time.monotonic() + timeout_s, 0.001
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


class Communicator(ABC):
    """One rank's membership of a broadcast group: `broadcast` moves a tensor from rank 0 to every rank."""

    device: torch.device
    """Where the tensors handed to `broadcast` must live."""
    wedged: bool = False
    """A collective timed out with work still queued on the device, which only ending this process frees (NCCL)."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` is sent; on every other rank it is overwritten in place. Raises when a peer fails."""

    @abstractmethod
    def synchronize(self) -> None:
        """Waits until every broadcast issued so far is done; CollectiveTimeout after the group's `timeout_s`."""

    @abstractmethod
    def close(self) -> None:
        """Leaves the group and frees what it holds; a closed (or failed) communicator is never used again."""


class GlooCommunicator(Communicator):
    """gloo over TCP on the CPU: a ProcessGroupGloo of our own, on a TCPStore that rank 0 hosts."""

    def __init__(self, group: BroadcastGroup, rank: int):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        timeout = datetime.timedelta(seconds=group.timeout_s)
        self.device = torch.device("cpu")
        # wait_for_workers=False: the ProcessGroupGloo constructor below is the rendezvous, bounded by `timeout`.
        self._store = TCPStore(
            group.master_address,
            group.master_port,
            group.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        self._group = ProcessGroupGloo(PrefixStore(_STORE_PREFIX, self._store), rank, group.world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self._group.broadcast([tensor], options).wait()

    def synchronize(self) -> None:
        pass  # each broadcast waited for its own completion

    def close(self) -> None:
        # Dropped explicitly: a gloo group whose peer died aborts the process if it is destroyed at interpreter exit.
        self._group = self._store = None


class NcclCommunicator(Communicator):
    """NCCL between GPUs: vLLM's PyNcclCommunicator over its StatelessProcessGroup. NOT exercised by CI."""

    def __init__(self, group: BroadcastGroup, rank: int, device: torch.device | None = None):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        if not torch.cuda.is_available():
            raise RuntimeError("an NCCL weight broadcast needs a GPU (use backend gloo on CPU)")
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self._timeout_s = group.timeout_s
        store = StatelessProcessGroup.create(
            host=group.master_address,
            port=group.master_port,
            rank=rank,
            world_size=group.world_size,
            store_timeout=int(group.timeout_s),
        )
        self._nccl = PyNcclCommunicator(store, device=self.device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._nccl.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def synchronize(self) -> None:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream())
        if not wait_until(done.query, self._timeout_s):
            self.wedged = True
            raise CollectiveTimeout(f"an NCCL broadcast did not complete within {self._timeout_s:g} s")

    def close(self) -> None:
        nccl, self._nccl = self._nccl, None
        if nccl is not None:
            nccl.destroy()  # ncclCommAbort (vLLM bounds it at 5 s): the communicator's GPU buffers are freed


def setup_communicator(group: BroadcastGroup, rank: int, device: torch.device | None = None) -> Communicator:
    """Joins `group` as `rank` with the communicator its backend names (blocks until every rank joined)."""
    if group.backend == "gloo":
        return GlooCommunicator(group, rank)
    return NcclCommunicator(group, rank, device)


class WeightSender:
    """The learner's end (rank 0): joins a group once, then broadcasts whole state dicts in manifest order.

    The learner's policy keeps one per group. When a broadcast fails the communicator is closed (so the
    other ranks see the failure at once instead of waiting out their timeout) and the error is raised.
    """

    def __init__(self, group: BroadcastGroup, device: torch.device | None = None):
        self.group = group
        self.communicator = setup_communicator(group, 0, device)

    def broadcast(self, tensors: Iterable[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Sends `tensors` in manifest order. They may be made as they are sent (a ZeRO-3 gather per parameter), so
        the sender holds one at a time; each moves to the communicator's device only if it is not there already.
        Every `bucket_bytes` it waits for the receivers (bounded by the group's timeout), so a dead peer is found."""
        try:
            sent = 0
            for tensor in tensors:
                self.communicator.broadcast(tensor.to(self.communicator.device).contiguous())
                sent += tensor.numel() * tensor.element_size()
                if sent >= bucket_bytes:
                    self.communicator.synchronize()
                    sent = 0
            self.communicator.synchronize()
        except BaseException:
            self.communicator.close()
            raise

    def close(self) -> None:
        self.communicator.close()


class HeldBytes:
    """Bytes of the tracked tensors still alive, and the most at any moment: what a receive holds beyond the model."""

    def __init__(self):
        self.now = self.peak = 0
        self._lock = threading.Lock()

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            self.now += size
            self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._release, size)
        return tensor

    def _release(self, size: int) -> None:
        with self._lock:
            self.now -= size


def receive_buckets(
    communicator: Communicator,
    entries: Sequence[tuple[str, TensorInfo]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    held: HeldBytes | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A receiving rank's side of one broadcast: the tensors of `entries` in order, a bucket of at most `bucket_bytes`
    at a time (a larger tensor is a bucket of its own), each bucket complete when it is yielded. Consumed lazily, the
    receiver holds one bucket plus whatever its consumer keeps; `held` counts the received tensors still alive."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, info in entries:
        if bucket and size + info.nbytes > bucket_bytes:
            communicator.synchronize()
            yield bucket
            bucket, size = [], 0
        tensor = torch.empty(info.shape, dtype=TORCH_DTYPE[info.dtype], device=communicator.device)
        if held is not None:
            held.track(tensor)
        communicator.broadcast(tensor)
        bucket.append((name, tensor))
        size += info.nbytes
    communicator.synchronize()
    if bucket:
        yield bucket


def receive_state_dict(
    communicator: Communicator, entries: Sequence[tuple[str, TensorInfo]]
) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of one broadcast, all held at once (checks and tools; a rollout worker loads bucket by bucket)."""
    return [pair for bucket in receive_buckets(communicator, entries, bucket_bytes=2**62) for pair in bucket]
