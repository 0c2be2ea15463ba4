"""A weight broadcast between two hosts that share no loopback (issue 45): the learner's rank 0 and a rollout worker,
each in a network namespace of its own, joined by a veth pair, as a learner pod and a rollout pod are.

The learner gives the group the address its deployment names (RLEP_NODE_ADDRESS, the pod IP in the Helm chart) and
the worker, in the other namespace, joins there and receives every tensor over gloo; the 127.0.0.1 that the learner
pod's loopback-held Ray names is refused before any replica is told to look for it. What rank 0's Ray actor answers
is checked against a real local Ray. Needs root and iproute2 (CI runs as root); skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
from dataclasses import dataclass
from multiprocessing.connection import wait

import pytest
import torch
from safetensors.torch import load, save, save_file

from rlep.services.weights.address import NODE_ADDRESS_ENV, node_address
from tests.integration import netns_peers

pytestmark = pytest.mark.integration

# TEST-NET-2 (RFC 5737): inside the two namespaces only, so it cannot clash with the machine's own networks.
LEARNER_IP, ROLLOUT_IP = "198.51.100.1", "198.51.100.2"
REPLICA = f"{ROLLOUT_IP}:50063"
# A join and each bucket are bounded by this; both ends start in ~2 s (spawn + imports), the tensors are small.
TIMEOUT_S = 20.0
# How long the test waits for a peer's next message: the peer's own start plus TIMEOUT_S.
WAIT_S = 60.0


@dataclass(frozen=True)
class Link:
    learner: str  # namespace names
    rollout: str
    learner_interface: str
    rollout_interface: str


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def link():
    """Two network namespaces joined by a veth pair: LEARNER_IP in one, ROLLOUT_IP in the other."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip` to make network namespaces")
    tag = os.getpid()
    link = Link(f"rlep-{tag}-learner", f"rlep-{tag}-rollout", f"rlep{tag}l", f"rlep{tag}r")
    made = _ip("netns", "add", link.learner)
    if made.returncode != 0:
        pytest.skip(f"this kernel or container refuses network namespaces: {made.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", link.rollout),
            ("link", "add", link.learner_interface, "netns", link.learner, "type", "veth")
            + ("peer", "name", link.rollout_interface, "netns", link.rollout),
            ("-n", link.learner, "addr", "add", f"{LEARNER_IP}/24", "dev", link.learner_interface),
            ("-n", link.rollout, "addr", "add", f"{ROLLOUT_IP}/24", "dev", link.rollout_interface),
        ]
        for namespace, interface in ((link.learner, link.learner_interface), (link.rollout, link.rollout_interface)):
            steps += [("-n", namespace, "link", "set", "lo", "up"), ("-n", namespace, "link", "set", interface, "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` refused: {done.stderr.strip()}")
        yield link
    finally:
        for namespace in (link.learner, link.rollout):  # deleting a namespace deletes its end of the veth pair
            _ip("netns", "del", namespace)


def tiny_state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(45)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=generator),
        "model.norm.weight": torch.randn(16, generator=generator).to(torch.bfloat16),
    }


def receive(conn, process) -> tuple:
    """The peer's next message; a failure as soon as the peer ends without one, or after WAIT_S."""
    if not wait([conn, process.sentinel], WAIT_S) or not conn.poll():
        pytest.fail(f"no message from {process.name} within {WAIT_S:g} s (exit code {process.exitcode})")
    return conn.recv()


def test_a_gloo_broadcast_reaches_another_host_at_the_learners_node_address(link, tmp_path):
    state_dict = tiny_state_dict()
    model_dir = tmp_path / "model"  # what the replica serves: the pushed names, dtypes and shapes
    model_dir.mkdir()
    save_file(state_dict, model_dir / "model.safetensors")
    (model_dir / "config.json").write_text("{}")
    spawn = multiprocessing.get_context("spawn")
    learner_conn, learner_child = spawn.Pipe()
    rollout_conn, rollout_child = spawn.Pipe()
    learner = spawn.Process(
        target=netns_peers.learner_end,
        args=(
            link.learner,
            link.learner_interface,
            LEARNER_IP,
            REPLICA,
            29650,
            save(state_dict),
            TIMEOUT_S,
            learner_child,
        ),
        name="learner",
    )
    rollout = None
    learner.start()
    try:
        kind, refusal = receive(learner_conn, learner)
        assert kind == "refused", "a loopback group address was accepted for a replica on another host"
        assert "127.0.0.1" in refusal and REPLICA in refusal, refusal
        kind, call = receive(learner_conn, learner)
        assert kind == "call"
        rollout = spawn.Process(
            target=netns_peers.rollout_end,
            args=(link.rollout, link.rollout_interface, model_dir, call, rollout_child),
            name="rollout",
        )
        rollout.start()
        joined_at, payload = receive(rollout_conn, rollout)
        received = load(payload)
        assert joined_at == LEARNER_IP
        assert received.keys() == state_dict.keys()  # (safetensors bytes keep no order)
        for name, tensor in state_dict.items():
            assert torch.equal(received[name], tensor), name
        assert receive(learner_conn, learner) == ("sent", None)
        for process in (learner, rollout):
            process.join(WAIT_S)
            assert process.exitcode == 0, f"{process.name} exited {process.exitcode}"
    finally:
        for process in (learner, rollout):
            if process is not None and process.is_alive():
                process.kill()
                process.join(10)


def test_rank_0_under_a_loopback_ray_names_127_0_0_1_unless_its_node_names_itself(ray_local):
    """Where `node_address` runs for a Ray policy: in rank 0's actor, a worker process of the Ray that `rlep train`
    starts without --ray-address. There Ray names 127.0.0.1 (what the check above refuses); RLEP_NODE_ADDRESS in that
    process's environment (the pod's, inherited by Ray's workers; given here through the task's) comes first."""
    remote_address = ray_local.remote(num_cpus=0)(node_address)
    assert ray_local.get(remote_address.remote()) == "127.0.0.1"
    named = remote_address.options(runtime_env={"env_vars": {NODE_ADDRESS_ENV: LEARNER_IP}})
    assert ray_local.get(named.remote()) == LEARNER_IP
