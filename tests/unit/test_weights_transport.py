"""Weight transports: the `weight_sync` variants, which transport each builds, and the calls each prepares."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import xxhash
from pydantic import TypeAdapter, ValidationError
from safetensors.torch import load

from rlep.common.config import CONFIG_DIR, load_config
from rlep.common.errors import UserError
from rlep.common.files import file_digest
from rlep.rollout.v1 import rollout_pb2
from rlep.services.learner.config import TrainConfig
from rlep.services.weights import transport as transport_module
from rlep.services.weights.broadcast import DEFAULT_BUCKET_BYTES, BroadcastGroup, manifest, manifest_digest
from rlep.services.weights.config import NcclSyncConfig, WeightSyncConfig
from rlep.services.weights.payload import read_header
from rlep.services.weights.transport import (
    AutoTransport,
    BroadcastTransport,
    SharedFileTransport,
    StreamTransport,
    setup_weight_transport,
)

SYNC = TypeAdapter(WeightSyncConfig)
STATE = {"embed.weight": torch.arange(12.0).reshape(3, 4), "norm.weight": torch.ones(4)}


@pytest.mark.parametrize(
    ("section", "transport"),
    [
        ({}, AutoTransport),  # no transport named: auto, the default
        ({"transport": "auto"}, AutoTransport),
        ({"transport": "stream"}, StreamTransport),
        ({"transport": "shared_file"}, SharedFileTransport),
    ],
)
def test_each_variant_builds_its_transport(section, transport):
    assert type(setup_weight_transport(SYNC.validate_python(section))) is transport


def test_nccl_fields_belong_to_the_nccl_variant_only():
    nccl = SYNC.validate_python({"transport": "nccl", "nccl_port": 29700, "workers_per_replica": 2, "backend": "gloo"})
    assert nccl == NcclSyncConfig(nccl_port=29700, workers_per_replica=2, backend="gloo")
    for transport in ("stream", "auto"):
        with pytest.raises(ValidationError, match="nccl_port"):
            SYNC.validate_python({"transport": transport, "nccl_port": 29700})
        with pytest.raises(ValidationError, match="backend"):
            SYNC.validate_python({"transport": transport, "backend": "gloo"})
    with pytest.raises(ValidationError, match="'auto', 'nccl' or 'gloo'"):
        SYNC.validate_python({"transport": "nccl", "backend": "mpi"})
    with pytest.raises(ValidationError, match="timeout_s"):
        SYNC.validate_python({"transport": "nccl", "timeout_s": 0})
    with pytest.raises(ValidationError, match="'auto', 'stream', 'shared_file', 'nccl'"):
        SYNC.validate_python({"transport": "carrier_pigeon"})


def test_a_train_config_reads_the_variant_from_yaml_and_overrides():
    recipe = load_config(TrainConfig, CONFIG_DIR / "recipes" / "rlep.yaml")
    assert recipe.weight_sync == NcclSyncConfig()
    assert load_config(TrainConfig, overrides={"weight_sync.transport": "stream"}).weight_sync.transport == "stream"
    assert TrainConfig().weight_sync.transport == "auto"


def test_nccl_needs_the_learners_sender():
    with pytest.raises(ValueError, match="needs the learner's policy"):
        setup_weight_transport(NcclSyncConfig())


@pytest.mark.parametrize(("backend", "chosen"), [("nccl", "nccl"), ("gloo", "gloo"), ("auto", "gloo")])
def test_the_backend_is_the_configured_one_and_auto_is_gloo_without_cuda(backend, chosen):
    assert not torch.cuda.is_available()  # CI's machines; on a GPU machine auto is nccl
    transport = setup_weight_transport(NcclSyncConfig(backend=backend, timeout_s=9), RecordingSender())
    assert type(transport) is BroadcastTransport
    group = transport.group(["a:1"])
    assert (group.backend, group.timeout_s) == (chosen, 9)


@pytest.mark.parametrize(
    ("addresses", "chosen"),
    [
        (["127.0.0.1:50063", "localhost:50064", "[::1]:50065"], SharedFileTransport),
        (["127.0.0.1:50063", "rollout-1.rollout.svc.cluster.local:50063"], StreamTransport),
    ],
)
def test_auto_uses_shared_memory_only_when_every_replica_is_local(addresses, chosen):
    assert type(AutoTransport().resolve(addresses)) is chosen


def test_a_stream_push_carries_the_payload_that_its_header_describes():
    with StreamTransport().prepare(STATE, 7, ["a:1", "b:2"]) as push:
        streams = [list(messages) for messages in push.requests]
    assert len(streams) == 2 and not push.all_replicas
    for header, *chunks in streams:
        payload = b"".join(c.data for c in chunks)
        assert header.header.version == 7 and header.header.total_bytes == len(payload)
        assert header.header.digest_algorithm == rollout_pb2.XXH3_128 and not header.header.sha256
        assert header.header.digest == xxhash.xxh3_128(payload).hexdigest()
        loaded = load(payload)  # streamed from the tensors' memory, it is still a safetensors file
        assert loaded.keys() == STATE.keys() and all(torch.equal(loaded[k], STATE[k]) for k in STATE)


def to_payload_data(state) -> bytes:
    return b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in state.values())


def test_streamed_chunks_stay_under_the_chunk_size(monkeypatch):
    monkeypatch.setattr(transport_module, "CHUNK_BYTES", 16)
    with StreamTransport().prepare(STATE, 7, ["a:1"]) as push:
        [[_, *chunks]] = [list(messages) for messages in push.requests]
    assert all(0 < len(c.data) <= 16 for c in chunks)
    assert b"".join(c.data for c in chunks) == transport_module.payload_of(STATE).head + to_payload_data(STATE)


def test_a_shared_file_push_names_a_file_that_lives_as_long_as_the_push():
    with SharedFileTransport().prepare(lambda: STATE, 3, ["a:1"]) as push:
        [[header, named]] = [list(messages) for messages in push.requests]
        path = named.shared_file
        assert header.header.version == 3 and set(read_header(Path(path))) == set(STATE)
        assert header.header.digest == file_digest(Path(path), "xxh3_128")
        assert header.header.total_bytes == os.path.getsize(path)
    assert not os.path.exists(path)


class RecordingSender:
    """The learner's side of an NCCL push, without GPUs: records what it was asked."""

    def __init__(self, device: str = "cpu"):
        self.manifests, self.broadcasts, self.device = 0, [], device

    def weight_manifest(self):
        self.manifests += 1
        return manifest(STATE)

    def broadcast_weights(self, group):
        self.broadcasts.append(group)

    def broadcast_address(self):
        return "10.0.0.5"

    def sender_device(self):
        return self.device


def test_broadcast_calls_carry_the_manifest_and_each_replicas_ranks():
    sender = RecordingSender()
    transport = BroadcastTransport(sender, first_port=29650, workers_per_replica=2, backend="gloo", timeout_s=7)

    def unread():
        raise AssertionError("the NCCL transport must not read the state dict")

    with transport.prepare(unread, 4, ["a:1", "b:2"]) as push:
        calls = [list(messages) for messages in push.requests]
    assert push.all_replicas
    group = BroadcastGroup("10.0.0.5", 29650, world_size=5, backend="gloo", timeout_s=7)
    for (header, chunk), offset in zip(calls, [1, 3], strict=True):
        assert header.header.version == 4 and header.header.sha256 == manifest_digest(manifest(STATE))
        nccl = chunk.nccl_broadcast
        assert (nccl.master_address, nccl.master_port, nccl.world_size) == ("10.0.0.5", 29650, 5)
        assert nccl.rank_offset == offset
        assert (nccl.backend, nccl.timeout_s, nccl.bucket_bytes) == (rollout_pb2.GLOO, 7, DEFAULT_BUCKET_BYTES)
        assert [t.name for t in nccl.tensors] == list(STATE)
    assert sender.broadcasts == []  # the broadcast waits until the calls are started
    push.after_start()
    assert sender.broadcasts == [group]

    # Same replicas: same group; another set of replicas: a new group on the next port. The manifest is read once.
    assert transport.group(["a:1", "b:2"]) == group
    assert transport.group(["a:1"]) == BroadcastGroup("10.0.0.5", 29651, 3, "gloo", 7)
    with transport.prepare(unread, 5, ["a:1"]):
        pass
    assert sender.manifests == 1


def test_the_configured_bucket_travels_in_every_call():
    transport = setup_weight_transport(NcclSyncConfig(backend="gloo", bucket_mb=0.25), RecordingSender())
    with transport.prepare(STATE, 1, ["a:1", "b:2"]) as push:
        buckets = [list(messages)[1].nccl_broadcast.bucket_bytes for messages in push.requests]
    assert buckets == [256 * 1024, 256 * 1024]


def test_a_failed_push_is_never_retried_on_its_group():
    """A rank may have left the group when a push fails: the next push of the same replicas gets a new port."""
    transport = BroadcastTransport(RecordingSender(), first_port=29650, backend="gloo")
    with pytest.raises(RuntimeError, match="peer died"), transport.prepare(STATE, 1, ["a:1"]):
        raise RuntimeError("peer died")
    with transport.prepare(STATE, 2, ["a:1"]) as push:
        [_, chunk] = list(push.requests[0])
        assert chunk.nccl_broadcast.master_port == 29651
    assert transport.group(["a:1"]).master_port == 29651  # kept after a push that went through


@pytest.mark.parametrize(("device", "backend"), [("cuda", "nccl"), ("cpu", "gloo")])
def test_auto_backend_follows_the_device_of_the_learners_rank_0_not_this_process(device, backend):
    # The driver (this test process) has no GPU; a rank 0 on CUDA still gets NCCL, as on a CPU-only head node.
    config = NcclSyncConfig(backend="auto")
    transport = setup_weight_transport(config, RecordingSender(device))
    assert transport.backend == backend


def reporting(**workers: int):
    """Replicas' GetStatus `workers` by address (`a=2` is replica "a:1" reporting 2; 0 = an older server)."""
    return lambda addresses: [workers[address.split(":")[0]] for address in addresses]


def rank_layout(transport, addresses) -> tuple[int, list[int]]:
    """(world size, each replica's rank offset) as the push's calls carry them."""
    with transport.prepare(STATE, 1, addresses) as push:
        chunks = [list(messages)[1].nccl_broadcast for messages in push.requests]
    assert len({c.world_size for c in chunks}) == 1
    return chunks[0].world_size, [c.rank_offset for c in chunks]


def test_the_group_follows_the_workers_each_replica_reports_not_the_learners_engine_config():
    """Replicas started elsewhere (endpoints.rollout, Helm, compose): the learner's own tensor_parallel_size (1 here)
    says nothing of theirs. Two TP=2 replicas take ranks 1-2 and 3-4 of 5; mixed sizes 2, 1, 4 take 1, 3, 4 of 8."""
    two = setup_weight_transport(NcclSyncConfig(backend="gloo"), RecordingSender(), 1, reporting(a=2, b=2))
    assert rank_layout(two, ["a:1", "b:2"]) == (5, [1, 3])
    mixed = BroadcastTransport(RecordingSender(), first_port=29650, reported_workers=reporting(a=2, b=1, c=4))
    assert rank_layout(mixed, ["a:1", "b:2", "c:3"]) == (8, [1, 3, 4])
    assert mixed.group(["a:1", "b:2", "c:3"]).world_size == 8
    assert rank_layout(mixed, ["c:3", "b:2"]) == (6, [1, 5])  # another set of replicas: its own group


def test_a_workers_per_replica_that_a_replica_contradicts_is_refused_naming_both():
    config = NcclSyncConfig(backend="gloo", workers_per_replica=2)
    transport = setup_weight_transport(config, RecordingSender(), reported_workers=reporting(a=2, b=4))
    with pytest.raises(UserError, match=r"workers_per_replica=2 but rollout replica b:2 reports 4 vLLM workers"):
        transport.group(["a:1", "b:2"])
    assert rank_layout(transport, ["a:1"]) == (3, [1])  # agreeing replicas form their group


def test_a_replica_that_does_not_report_counts_as_the_config_with_a_warning(caplog):
    """An older server (GetStatus without `workers`): workers_per_replica when set, else this run's engine config."""
    older = reporting(a=0, b=2)
    unset = setup_weight_transport(NcclSyncConfig(backend="gloo"), RecordingSender(), 4, reported_workers=older)
    with caplog.at_level(logging.WARNING, logger="rlep.services.weights.broadcast"):
        assert rank_layout(unset, ["a:1", "b:2"]) == (7, [1, 5])
    assert "rollout replica a:1 does not report its vLLM workers" in caplog.text and "counting 4" in caplog.text
    assert "b:2" not in caplog.text  # a replica that reports is not warned about
    configured = NcclSyncConfig(backend="gloo", workers_per_replica=2)
    transport = setup_weight_transport(configured, RecordingSender(), 4, reported_workers=older)
    assert rank_layout(transport, ["a:1", "b:2"]) == (5, [1, 3])


def test_a_workers_per_replica_other_than_the_started_replicas_tensor_parallel_size_is_refused():
    engine = {"rollout_engine": {"tensor_parallel_size": 2}}
    with pytest.raises(ValidationError, match="workers_per_replica=1 but .* tensor_parallel_size=2"):
        TrainConfig.model_validate({"local": engine, "weight_sync": {"transport": "nccl", "workers_per_replica": 1}})
    TrainConfig.model_validate({"local": engine, "weight_sync": {"transport": "nccl"}})
    elsewhere = {"rollout": ["10.0.0.7:50063"]}  # replicas started elsewhere: their size is the user's to give
    TrainConfig.model_validate(
        {"local": engine, "endpoints": elsewhere, "weight_sync": {"transport": "nccl", "workers_per_replica": 1}}
    )
