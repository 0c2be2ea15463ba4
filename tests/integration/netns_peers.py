"""The two ends of a weight broadcast, each in a network namespace of its own (test_weights_broadcast_netns.py): two
hosts that reach each other over one link and share no loopback. Run with the `spawn` start method; each process
enters its namespace before it opens a socket, then runs the production code of its end: the learner's
`BroadcastTransport` and `WeightSender`, and the rollout server's check of a broadcast call (`WeightIntake`)
followed by a worker's `setup_communicator` and `receive_state_dict`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
from safetensors.torch import load, save

from rlep.common.errors import UserError
from rlep.rollout.v1 import rollout_pb2
from rlep.services.rollout.requests import WeightIntake
from rlep.services.weights.address import NODE_ADDRESS_ENV, node_address
from rlep.services.weights.broadcast import (
    BroadcastGroup,
    WeightSender,
    manifest,
    receive_state_dict,
    setup_communicator,
)
from rlep.services.weights.transport import BroadcastTransport

CLONE_NEWNET = 0x40000000  # <sched.h>


def enter_namespace(name: str, interface: str) -> None:
    """Moves this process into network namespace `name` (made by `ip netns add`)."""
    libc = ctypes.CDLL(None, use_errno=True)  # os.setns is Python 3.12+
    with open(f"/run/netns/{name}") as namespace:
        if libc.setns(namespace.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    # gloo binds its own connections where this host's name resolves, an address not in this namespace (so it would
    # fall back to loopback): name the link, as a host whose name resolves elsewhere does.
    os.environ["GLOO_SOCKET_IFNAME"] = interface


class LearnerRank0:
    """The learner's policy at rank 0 for a plain state dict: says where it is, sends with `WeightSender`."""

    def __init__(self, state_dict: dict[str, torch.Tensor], address: str | None = None):
        self.state_dict, self.address, self.sender = state_dict, address, None

    def weight_manifest(self):
        return manifest(self.state_dict)

    def broadcast_weights(self, group: BroadcastGroup) -> None:
        self.sender = WeightSender(group)
        self.sender.broadcast(self.state_dict.values())

    def broadcast_address(self) -> str:
        """`address` when given, else the learner's own choice (`DeepSpeedPolicy.broadcast_address`)."""
        return self.address or node_address()

    def sender_device(self) -> str:
        return "cpu"


def learner_end(namespace, interface, own_address, replica, port, payload: bytes, timeout_s, conn) -> None:
    """Rank 0 of the learner at `own_address` pushing `payload` (safetensors bytes) to the replica at `replica`
    (`host:port`). First as the learner pod's loopback-held Ray names it (127.0.0.1): refused. Then with
    RLEP_NODE_ADDRESS set, as the Helm chart sets it: the replica's call goes to `conn`, then the tensors are
    broadcast once it has joined. Tensors cross the pipes as bytes: torch would pass them by file descriptors over a
    socket of the sending process, which the other namespace may not reach."""
    enter_namespace(namespace, interface)
    state_dict = load(payload)
    loopback = BroadcastTransport(LearnerRank0(state_dict, "127.0.0.1"), port, backend="gloo", timeout_s=timeout_s)
    try:
        loopback.group([replica])
        conn.send(("not refused", None))
        return
    except UserError as refused:
        conn.send(("refused", str(refused)))
    os.environ[NODE_ADDRESS_ENV] = own_address
    transport = BroadcastTransport(LearnerRank0(state_dict), port, backend="gloo", timeout_s=timeout_s)
    with transport.prepare(state_dict, 1, [replica]) as push:
        [call] = push.requests
        conn.send(("call", [message.SerializeToString() for message in call]))
        push.after_start()
    conn.send(("sent", None))


def rollout_end(namespace, interface, model_dir: Path, call: list[bytes], conn) -> None:
    """A replica's worker: checks the call as the rollout server does, joins the group it names and receives; sends
    the group's address and what it received (safetensors bytes) to `conn`."""
    enter_namespace(namespace, interface)
    header, broadcast = (rollout_pb2.WeightChunk.FromString(message) for message in call)
    intake = WeightIntake(model_dir, model_dir, [])
    group, entries = intake.broadcast_entries(header.header, broadcast.nccl_broadcast, iter([]))
    communicator = setup_communicator(group, broadcast.nccl_broadcast.rank_offset)
    try:
        conn.send((group.master_address, save(dict(receive_state_dict(communicator, entries)))))
    finally:
        communicator.close()
