"""Processes that take part in a weight broadcast and die at a chosen tensor (SIGKILL, as a crash would).

Each runs the production code of its end (`WeightSender`, or `setup_communicator` + `receive_state_dict` as a
rollout worker does) with its communicator wrapped so that the process kills itself right after the
`die_after`-th tensor: the failure happens at a known point of the broadcast, not after a guessed sleep.
Run with the `spawn` start method (the test process holds vLLM and gRPC threads).
"""

from __future__ import annotations

import os
import signal

import torch

from rlep.services.weights.broadcast import (
    BroadcastGroup,
    Communicator,
    WeightSender,
    receive_state_dict,
    setup_communicator,
)
from rlep.services.weights.payload import TensorInfo


class DiesAfter(Communicator):
    """Passes every call to `inner`; SIGKILLs this process once `tensors` broadcasts have completed."""

    def __init__(self, inner: Communicator, tensors: int):
        self.inner, self.left, self.device = inner, tensors, inner.device

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.inner.broadcast(tensor)
        self.left -= 1
        if self.left == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        self.inner.close()


def send_and_die(group: BroadcastGroup, state_dict: dict[str, torch.Tensor], die_after: int) -> None:
    """Rank 0: the learner's sender, killed after sending `die_after` tensors."""
    sender = WeightSender(group)
    sender.communicator = DiesAfter(sender.communicator, die_after)
    sender.broadcast(state_dict.values())


def receive_and_die(group: BroadcastGroup, rank: int, entries: list[tuple[str, TensorInfo]], die_after: int) -> None:
    """A receiving rank, as a rollout worker receives, killed after `die_after` tensors."""
    receive_state_dict(DiesAfter(setup_communicator(group, rank), die_after), entries)
