"""Pure logic of the rollout client and request checks: sharding, prompt kinds, unknown fields, failover of
generation and of weight pushes."""

from __future__ import annotations

from contextlib import contextmanager

import grpc
import pytest
import torch

from rlep.common.grpc_validation import unknown_field_paths
from rlep.rollout.v1 import rollout_pb2
from rlep.services.rollout.client import RolloutClient, RolloutError, prompt_to_proto, split_evenly
from rlep.services.rollout.types import Sampling
from rlep.services.weights.transport import WeightPush, WeightTransport


@pytest.mark.parametrize(("count", "parts"), [(10, 3), (2, 5), (0, 2), (7, 1), (64, 4)])
def test_split_evenly_covers_in_order(count, parts):
    ranges = split_evenly(count, parts)
    assert [i for r in ranges for i in r] == list(range(count))
    sizes = [len(r) for r in ranges]
    assert all(sizes) and (not sizes or max(sizes) - min(sizes) <= 1) and len(ranges) <= parts


def test_prompt_kinds():
    assert prompt_to_proto("Q: 1\nA: ").WhichOneof("kind") == "text"
    assert list(prompt_to_proto([3, 4, 5]).tokens.token_ids) == [3, 4, 5]
    chat = prompt_to_proto([{"role": "user", "content": "hi"}])
    assert chat.chat.messages[0].role == "user" and chat.chat.messages[0].content == "hi"


def test_unknown_fields_are_found_at_any_depth():
    request = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="a"), rollout_pb2.Prompt(text="b")])
    assert unknown_field_paths(request) == []
    varint_field_77 = bytes([77 << 3 & 0x7F | 0x80, 77 >> 4, 1])
    nested = rollout_pb2.Prompt.FromString(rollout_pb2.Prompt(text="b").SerializeToString() + varint_field_77)
    request.prompts[1].CopyFrom(nested)
    assert unknown_field_paths(request) == ["GenerateRequest.prompts[1]"]


class _Down(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "replica gone"


class _Stub:
    def __init__(self, reply=None):
        self.reply, self.calls = reply, 0

    def Generate(self, request, timeout=None):  # noqa: N802 - the gRPC stub's method name
        self.calls += 1
        if self.reply is None:
            raise _Down()
        return self.reply


def test_a_shard_whose_replica_is_down_goes_to_the_next_and_is_counted():
    reply = rollout_pb2.GenerateResponse(completions=[rollout_pb2.Completion(prompt_token_ids=[1, 2])])
    client = RolloutClient(["127.0.0.1:1", "127.0.0.1:2"], attempts=1)
    try:
        down, up = _Stub(), _Stub(reply)
        client.replicas[0].stub, client.replicas[1].stub = down, up
        [completion] = client.generate([[1, 2]], Sampling(max_tokens=4))
        assert completion.prompt_token_ids == [1, 2]
        assert (down.calls, up.calls, client.failovers) == (1, 1, 1)
    finally:
        client.close()


class _WeightStub:
    """A replica's UpdateWeights: reads the whole message stream, or is down."""

    def __init__(self, up=True):
        self.up, self.received = up, []

    def UpdateWeights(self, messages, timeout=None):  # noqa: N802 - the gRPC stub's method name
        if not self.up:
            raise _Down()
        self.received = list(messages)
        return rollout_pb2.UpdateWeightsResponse(version=self.received[0].header.version)


class _HeaderOnly(WeightTransport):
    def __init__(self, all_replicas: bool):
        self.all_replicas = all_replicas

    @contextmanager
    def prepare(self, weights, version, addresses):
        header = rollout_pb2.WeightChunk(header=rollout_pb2.WeightHeader(version=version))
        yield WeightPush([iter([header]) for _ in addresses], all_replicas=self.all_replicas)


@pytest.fixture
def two_replicas():
    client = RolloutClient(["127.0.0.1:1", "127.0.0.1:2"], attempts=1)
    yield client
    client.close()


def test_local_replicas_get_a_shared_file_by_default(two_replicas):
    stubs = [_WeightStub(), _WeightStub()]
    two_replicas.replicas[0].stub, two_replicas.replicas[1].stub = stubs
    replies = two_replicas.push_weights({"w": torch.ones(2)}, 5)
    assert [r.version for r in replies] == [5, 5]
    assert all([m.WhichOneof("kind") for m in s.received] == ["header", "shared_file"] for s in stubs)


def test_a_replica_down_during_a_push_leaves_serving_until_it_is_back(two_replicas):
    down, up = two_replicas.replicas
    down.stub, up.stub = _WeightStub(up=False), _WeightStub()
    [reply] = two_replicas.push_weights({}, 3, transport=_HeaderOnly(all_replicas=False))
    assert reply.version == 3 and two_replicas.serving() == [up]
    up.stub.up = False
    with pytest.raises(RolloutError, match="no rollout replica took the weights"):
        two_replicas.push_weights({}, 4, transport=_HeaderOnly(all_replicas=False))


def test_a_push_that_needs_every_replica_fails_when_one_is_down(two_replicas):
    two_replicas.replicas[0].stub, two_replicas.replicas[1].stub = _WeightStub(up=False), _WeightStub()
    with pytest.raises(grpc.RpcError):
        two_replicas.push_weights({}, 3, transport=_HeaderOnly(all_replicas=True))
    assert two_replicas.serving() == two_replicas.replicas
