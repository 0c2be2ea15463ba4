"""The broadcast weight path end to end on CPU: gloo in place of NCCL, a real vLLM CPU worker behind gRPC.

Rank 0 is this test process (the learner's `WeightSender`, through `BroadcastTransport` and `RolloutClient`) or a
subprocess that dies at a chosen tensor (tests/integration/broadcast_peers.py); rank 1 is the session's rollout
replica. What only NCCL could show (GPU memory, CUDA streams, NCCL's behaviour when a peer dies) is not here.
"""

from __future__ import annotations

import multiprocessing
import signal
import time

import grpc
import psutil
import pytest
import torch

from rlep.common.ports import free_port
from rlep.rollout.v1 import rollout_pb2
from rlep.services.rollout.types import Sampling
from rlep.services.weights.broadcast import DEFAULT_BUCKET_BYTES, BroadcastGroup, WeightSender, manifest
from rlep.services.weights.transport import BroadcastTransport, broadcast_messages
from tests.integration import broadcast_peers
from tests.integration.test_rollout import PROMPT, hf_logprobs, perturbed_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Generous for a loaded 2-core box; the failure tests check that a dead peer is reported well before it.
TIMEOUT_S = 30.0
GREEDY = Sampling(n=1, temperature=0.0, max_tokens=12)


class StateDictSender:
    """The learner's side of a broadcast push for a plain state dict: the learner's `WeightSender` at rank 0."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state_dict, self.sender = state_dict, None

    def weight_manifest(self):
        return manifest(self.state_dict)

    def broadcast_weights(self, group: BroadcastGroup) -> None:
        if self.sender is None or self.sender.group != group:
            self.sender = WeightSender(group)
        self.sender.broadcast(self.state_dict.values())

    def broadcast_address(self) -> str:
        return "127.0.0.1"

    def sender_device(self) -> str:
        return "cpu"


def gloo_push(rollout_client, state_dict, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    transport = BroadcastTransport(
        StateDictSender(state_dict),
        free_port(),
        backend="gloo",
        timeout_s=TIMEOUT_S,
        bucket_bytes=bucket_bytes,
        reported_workers=rollout_client.reported_workers,  # as the learner builds it: the group from GetStatus
    )
    return rollout_client.push_weights(
        lambda: pytest.fail("a broadcast never reads the state dict"), version, transport
    )


def greedy(rollout_client):
    [completion] = rollout_client.generate([PROMPT], GREEDY)
    [sample] = completion.samples
    return completion.prompt_token_ids, sample


def assert_serves(rollout_client, hf_model, state_dict, version: int) -> None:
    """The replica is at `version` and its logprobs are an HF forward of `state_dict` (every tensor in its place)."""
    prompt_ids, sample = greedy(rollout_client)
    assert sample.policy_version == version
    expected = hf_logprobs(hf_model, state_dict, prompt_ids, sample.token_ids)
    worst = (torch.tensor(sample.logprobs) - expected).abs().max().item()
    assert worst < 1e-4, f"max |vLLM - transformers| logprob difference {worst}"


def test_a_gloo_broadcast_loads_the_learners_weights(rollout_client, rollout, hf_model):
    """Handshake, manifest, tensor order and version: after a gloo push the worker computes what HF computes."""
    for version in (rollout.engine.version + 1, rollout.engine.version + 2):  # a second push reuses the group
        state_dict = perturbed_state_dict(hf_model, seed=version)
        [reply] = gloo_push(rollout_client, state_dict, version)
        assert reply.version == version and rollout_client.versions() == [version]
        assert_serves(rollout_client, hf_model, state_dict, version)


def test_a_push_in_buckets_holds_one_bucket_not_a_second_copy_of_the_model(rollout_client, rollout, hf_model):
    """The worker loads each bucket as it arrives: the received tensors alive at once stay near one bucket (plus the
    layer vLLM's layerwise reload buffers until complete), where the whole model is held when it fits one bucket."""
    version = rollout.engine.version
    state_dict = perturbed_state_dict(hf_model, seed=version + 1)
    sizes = [t.numel() * t.element_size() for t in state_dict.values()]
    total, bucket = sum(sizes), max(sizes)

    [whole] = gloo_push(rollout_client, state_dict, version + 1)  # the default bucket holds this model whole
    assert whole.receive_peak_bytes == total
    state_dict = perturbed_state_dict(hf_model, seed=version + 2)
    [bucketed] = gloo_push(rollout_client, state_dict, version + 2, bucket_bytes=bucket)
    print(
        f"push of {total} bytes: peak {whole.receive_peak_bytes} whole, {bucketed.receive_peak_bytes} in buckets "
        f"of {bucket} ({len(sizes)} tensors)"
    )
    # At most the bucket being loaded plus a layer begun in the previous one (vLLM loads a layer once it is complete).
    assert bucket <= bucketed.receive_peak_bytes <= bucket + _largest_layer_bytes(state_dict) < total / 2
    assert_serves(rollout_client, hf_model, state_dict, version + 2)


def _open_files(pid: int) -> int:
    """Files open in the EngineCore process `pid` and in its workers (where the group's sockets live)."""
    core = psutil.Process(pid)
    return sum(p.num_fds() for p in [core, *core.children(recursive=True)])


def _largest_layer_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes of the largest vLLM layer: q/k/v load into one fused qkv_proj, gate/up into gate_up_proj."""
    layers: dict[str, int] = {}
    for name, tensor in state_dict.items():
        layer = name.replace("q_proj", "qkv").replace("k_proj", "qkv").replace("v_proj", "qkv")
        layer = layer.replace("gate_proj", "gate_up").replace("up_proj", "gate_up").rsplit(".", 1)[0]
        layers[layer] = layers.get(layer, 0) + tensor.numel() * tensor.element_size()
    return max(layers.values())


def test_twenty_pushes_through_new_groups_leave_no_group_behind(rollout_client, rollout, hf_model):
    """Each push forms a new group (a new transport, on a new port): the worker leaves the previous one, so the
    sockets its engine core holds do not grow with the number of groups it has been in."""
    [core] = rollout.engine._llm.llm_engine.engine_core.resources.engine_manager.processes  # vLLM's EngineCore
    version = rollout.engine.version
    state_dict = perturbed_state_dict(hf_model, seed=version + 1)
    gloo_push(rollout_client, state_dict, version + 1)
    before = _open_files(core.pid)
    for push in range(2, 22):
        gloo_push(rollout_client, state_dict, version + push)
    after = _open_files(core.pid)
    print(f"engine core and workers: {before} open files after the first group, {after} after 20 more")
    assert after <= before + 2, f"{after - before} files left open by 20 groups"


def test_a_wrong_manifest_is_refused_before_joining(stub, rollout, hf_model):
    """Nobody listens on the group's port: a worker that tried to join would wait out the timeout."""
    version = rollout.engine.version
    entries = manifest(perturbed_state_dict(hf_model, 5))
    wrong = [(n, type(i)(i.dtype, (7,)) if n == "model.norm.weight" else i) for n, i in entries]
    group = BroadcastGroup("127.0.0.1", free_port(), 2, "gloo", TIMEOUT_S)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(iter(broadcast_messages(version + 1, wrong, group, 1)), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not fit the model" in info.value.details()
    assert time.monotonic() - started < TIMEOUT_S / 3
    assert stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).policy_version == version


def _spawn(target, *args) -> multiprocessing.Process:
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def _assert_failed_promptly(call, started: float, version: int) -> None:
    """The replica's call failed with ABORTED, saying it still serves `version`, well before the timeout."""
    error = call.exception(timeout=TIMEOUT_S * 2)
    assert isinstance(error, grpc.RpcError), "the replica took a broadcast whose peer died"
    assert error.code() == grpc.StatusCode.ABORTED and f"version {version} still serves" in error.details()
    assert time.monotonic() - started < TIMEOUT_S, "the dead peer was found by the timeout, not by its closed socket"


def test_a_sender_that_dies_mid_broadcast_leaves_the_old_weights_serving(stub, rollout_client, rollout, hf_model):
    version = rollout.engine.version
    _, before = greedy(rollout_client)
    state_dict = perturbed_state_dict(hf_model, seed=version + 1)
    group = BroadcastGroup("127.0.0.1", free_port(), 2, "gloo", TIMEOUT_S)
    started = time.monotonic()
    call = stub.UpdateWeights.future(iter(broadcast_messages(version + 1, manifest(state_dict), group, 1)))
    sender = _spawn(broadcast_peers.send_and_die, group, state_dict, 3)
    sender.join(TIMEOUT_S * 2)
    assert sender.exitcode == -signal.SIGKILL  # it died where the test put the hook, after 3 of its tensors
    _assert_failed_promptly(call, started, version)
    _, after = greedy(rollout_client)
    assert (after.token_ids, after.logprobs, after.policy_version) == (before.token_ids, before.logprobs, version)

    [reply] = gloo_push(rollout_client, state_dict, version + 1)  # the next push: a new group, and it lands
    assert reply.version == version + 1
    assert_serves(rollout_client, hf_model, state_dict, version + 1)


def test_a_worker_that_dies_mid_broadcast_fails_the_push_and_the_next_succeeds(stub, rollout_client, rollout, hf_model):
    """Rank 2, a receiving worker, dies after 3 tensors: the sender and the live replica both fail promptly."""
    version = rollout.engine.version
    _, before = greedy(rollout_client)
    state_dict = perturbed_state_dict(hf_model, seed=version + 1)
    entries = manifest(state_dict)
    group = BroadcastGroup("127.0.0.1", free_port(), 3, "gloo", TIMEOUT_S)
    started = time.monotonic()
    call = stub.UpdateWeights.future(iter(broadcast_messages(version + 1, entries, group, 1)))
    worker = _spawn(broadcast_peers.receive_and_die, group, 2, entries, 3)
    with pytest.raises(RuntimeError):  # gloo: the connection to rank 2 was reset or closed
        WeightSender(group).broadcast(state_dict.values())
    worker.join(TIMEOUT_S)
    assert worker.exitcode == -signal.SIGKILL
    _assert_failed_promptly(call, started, version)
    _, after = greedy(rollout_client)
    assert (after.token_ids, after.logprobs, after.policy_version) == (before.token_ids, before.logprobs, version)

    [reply] = gloo_push(rollout_client, state_dict, version + 1)
    assert reply.version == version + 1
    assert_serves(rollout_client, hf_model, state_dict, version + 1)
