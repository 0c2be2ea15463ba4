"""Pure logic of the rollout client and request checks: sharding, prompt kinds, unknown fields, failover."""

from __future__ import annotations

import grpc
import pytest

from rlep.common.grpc_utils import unknown_field_paths
from rlep.rollout.v1 import rollout_pb2
from rlep.services.rollout.client import RolloutClient, prompt_to_proto, split_evenly
from rlep.services.rollout.types import Sampling


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
