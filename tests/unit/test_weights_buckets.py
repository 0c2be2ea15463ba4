"""Bucketed receive, bounded waits and communicator teardown (pure logic: a recording communicator stands in for
gloo / NCCL; tests/integration/test_weights_broadcast.py runs the real path against a vLLM worker)."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlep.services.weights.broadcast import (
    Communicator,
    HeldBytes,
    NcclCommunicator,
    WeightSender,
    manifest,
    receive_buckets,
    wait_until,
)


class Recording(Communicator):
    """Fills each received tensor with its index and records the order of broadcasts and synchronizations."""

    def __init__(self):
        self.device, self.events, self.closed = torch.device("cpu"), [], False

    def broadcast(self, tensor: torch.Tensor) -> None:
        tensor.fill_(sum(e == "tensor" for e in self.events))
        self.events.append("tensor")

    def synchronize(self) -> None:
        self.events.append("sync")

    def close(self) -> None:
        self.closed = True


# 16, 16, 64 and 8 bytes.
ENTRIES = manifest({"a": torch.zeros(4), "b": torch.zeros(4), "big": torch.zeros(16), "c": torch.zeros(2)})


def test_buckets_hold_at_most_bucket_bytes_and_a_larger_tensor_alone():
    communicator = Recording()
    buckets = [[name for name, _ in b] for b in receive_buckets(communicator, ENTRIES, bucket_bytes=32)]
    assert buckets == [["a", "b"], ["big"], ["c"]]
    # Every bucket is complete (synchronized) before its consumer sees it.
    assert communicator.events == ["tensor", "tensor", "sync", "tensor", "sync", "tensor", "sync"]


def test_tensors_arrive_in_manifest_order_with_their_shapes():
    received = [pair for b in receive_buckets(Recording(), ENTRIES, bucket_bytes=32) for pair in b]
    assert [(n, tuple(t.shape), t[0].item()) for n, t in received] == [
        ("a", (4,), 0),
        ("b", (4,), 1),
        ("big", (16,), 2),
        ("c", (2,), 3),
    ]


def test_a_lazy_consumer_that_drops_each_tensor_holds_one_bucket_at_most():
    held = HeldBytes()
    for bucket in receive_buckets(Recording(), ENTRIES, bucket_bytes=32, held=held):
        while bucket:
            bucket.pop(0)
    assert held.peak == 64 and held.now == 0  # the lone 64-byte tensor; nothing outlives the receive


def test_a_consumer_keeping_everything_holds_the_whole_model():
    held = HeldBytes()
    kept = [pair for b in receive_buckets(Recording(), ENTRIES, bucket_bytes=32, held=held) for pair in b]
    assert held.peak == held.now == 104 and len(kept) == 4


def test_the_sender_waits_for_its_peers_every_bucket():
    sender = object.__new__(WeightSender)
    sender.communicator = Recording()
    sender.broadcast([torch.zeros(4), torch.zeros(4), torch.zeros(16), torch.zeros(2)], bucket_bytes=32)
    assert sender.communicator.events == ["tensor", "tensor", "sync", "tensor", "sync", "tensor", "sync"]


def test_a_failed_send_closes_the_communicator():
    class Failing(Recording):
        def synchronize(self):
            raise RuntimeError("peer gone")

    sender = object.__new__(WeightSender)
    sender.communicator = Failing()
    with pytest.raises(RuntimeError, match="peer gone"):
        sender.broadcast([torch.zeros(4)])
    assert sender.communicator.closed


def test_wait_until_gives_up_after_its_timeout_and_returns_once_done():
    assert wait_until(lambda: False, timeout_s=0.05) is False
    polls = itertools.count()
    assert wait_until(lambda: next(polls) >= 3, timeout_s=5.0) is True


def test_closing_an_nccl_communicator_destroys_it_once():
    """vLLM's PyNcclCommunicator keeps its GPU buffers until `destroy()` (ncclCommAbort); dropping it leaks them."""

    class PyNccl:
        destroyed = 0

        def destroy(self):
            PyNccl.destroyed += 1

    communicator = object.__new__(NcclCommunicator)
    communicator._nccl = PyNccl()
    communicator.close()
    communicator.close()
    assert PyNccl.destroyed == 1
