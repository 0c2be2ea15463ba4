"""A rollout engine's end of a weight broadcast: its vLLM workers join the learner's group, receive a version a bucket
at a time (worker_extension.py), and their outcomes decide whether the model can go on serving.

Runs on the engine thread only (engine.py queues a broadcast between two generation batches), so it needs no lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlep.services.weights.broadcast import BroadcastGroup
from rlep.services.weights.payload import TensorInfo


class BroadcastFailed(RuntimeError):
    """A weight broadcast that did not complete (a peer died, or it timed out); the previous weights still serve."""


class ModelCorrupted(RuntimeError):
    """A broadcast failed after loading began, or a collective is stuck on the device: the model cannot serve again."""


@dataclass(frozen=True)
class BroadcastReceipt:
    load_seconds: float
    peak_bytes: int
    """Most bytes of received tensors one worker held at once: the push's memory beyond the model."""


def broadcast_problem(backend: str) -> str | None:
    """Why this process's workers cannot receive a broadcast over `backend`, or None (gloo runs anywhere)."""
    import torch

    if backend == "nccl" and not torch.cuda.is_available():
        return "a weight broadcast over NCCL needs a GPU worker; this one runs on CPU (use backend gloo)"
    return None


class BroadcastReceiver:
    """Keeps which group the workers are in (joined again only when a push names another) and runs one receive."""

    def __init__(self, llm):
        self._llm = llm  # vllm.LLM built with worker_extension.WeightSyncExtension
        self._joined: tuple[BroadcastGroup, int] | None = None  # (group, rank offset) the workers are members of

    def receive(
        self,
        group: BroadcastGroup,
        rank_offset: int,
        entries: Sequence[tuple[str, TensorInfo]],
        bucket_bytes: int,
        versions: tuple[int, int],
    ) -> list[dict]:
        """Every worker's outcome of receiving `entries`. Raises BroadcastFailed when one failed before loading began
        (the workers left the group; the sender's next push forms a new one) and ModelCorrupted when one failed after;
        anything vLLM raises (a dead engine core) passes through, the group forgotten."""
        names = [name for name, _ in entries]
        dtypes = [info.dtype for _, info in entries]
        shapes = [list(info.shape) for _, info in entries]
        try:
            if self._joined != (group, rank_offset):
                self._joined = None
                args = (group.master_address, group.master_port, rank_offset, group.world_size)
                self._llm.collective_rpc("init_weight_broadcast", args=(*args, group.backend, group.timeout_s))
                self._joined = (group, rank_offset)
            outcomes = self._llm.collective_rpc("receive_weight_broadcast", args=(names, dtypes, shapes, bucket_bytes))
        except Exception:
            self._joined = None
            raise
        if errors := [o["error"] for o in outcomes if o["error"]]:
            self._joined = None
            current, new = versions
            if any(o["loading"] or o["wedged"] for o in outcomes):  # some worker's layers are no longer `current`
                raise ModelCorrupted(
                    f"a weight broadcast failed after loading began ({errors[0]}): the model is part version "
                    f"{current}, part version {new}, so this worker retires"
                )
            raise BroadcastFailed(f"the weight broadcast failed, version {current} still serves: {errors[0]}")
        return outcomes
