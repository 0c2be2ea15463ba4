"""The learner's side of a payload weight push, run in the learner process that holds the weights (rank 0).

`Trainer.push_weights` hands the policy a `ReplicaTarget` (addresses, token, deadline: plain values) and the
run's `weight_sync`; rank 0 writes the payload and makes the `UpdateWeights` calls itself through a
`RolloutClient` of its own, and only the small `PushResult` (who took the version, who was down) goes back.
So no weight crosses Ray's object store or the driver. The NCCL transport is not run here: its calls start
in the driver and its tensors never leave the learner's devices but to the workers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch

from rlep.services.rollout.client import PushResult, ReplicaTarget, RolloutClient
from rlep.services.weights.config import WeightSyncConfig
from rlep.services.weights.transport import setup_weight_transport

# The engine dtypes a push can be cast to (RolloutStatus.dtype names).
ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def push_dtype(target: ReplicaTarget, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The dtype weights travel in: the replicas' engine dtype when they report one (vLLM casts to it on load
    anyway: casting here sends a float32 learner's weights to bfloat16 replicas in half the bytes, cast once, with
    the same rounding), else the starting checkpoint's."""
    return ENGINE_DTYPES.get(target.dtype or "", checkpoint_dtype)


# Clients kept per target: the serving set, plus the few subsets that rejoining replicas make.
MAX_CLIENTS = 4


class WeightPusher:
    """Pushes full state dicts to rollout replicas from this process, keeping a client per target."""

    def __init__(self) -> None:
        self._clients: OrderedDict[ReplicaTarget, RolloutClient] = OrderedDict()

    def push(
        self, weights: Mapping[str, torch.Tensor], target: ReplicaTarget, version: int, sync: WeightSyncConfig
    ) -> PushResult:
        """Sends `weights` as `version` to every replica of `target` by `sync`'s (payload) transport."""
        return self._client(target).deliver_weights(weights, version, setup_weight_transport(sync))

    def _client(self, target: ReplicaTarget) -> RolloutClient:
        if target in self._clients:
            self._clients.move_to_end(target)
            return self._clients[target]
        self._clients[target] = client = RolloutClient.from_target(target)
        while len(self._clients) > MAX_CLIENTS:
            _, old = self._clients.popitem(last=False)
            old.close()
        return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
