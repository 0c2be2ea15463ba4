"""Data chunks encoded and decoded without protobuf copies: the same bytes as protobuf's, both ways."""

from __future__ import annotations

import os

import pytest
from google.protobuf.message import DecodeError

from rlep.rollout.v1 import rollout_pb2
from rlep.services.weights.wire import DataChunk, decode_chunk, encode_chunk


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 4 * 1024 * 1024 + 3])
def test_a_data_chunk_is_encoded_as_protobuf_encodes_it_and_decoded_as_a_view(size):
    data = os.urandom(size)
    wire = encode_chunk(DataChunk(memoryview(data)))
    assert wire == rollout_pb2.WeightChunk(data=data).SerializeToString()
    decoded = decode_chunk(wire)
    assert isinstance(decoded, DataChunk) and decoded.WhichOneof("kind") == "data"
    assert isinstance(decoded.data, memoryview) and decoded.data.tobytes() == data


def test_other_chunks_go_through_protobuf():
    header = rollout_pb2.WeightChunk(header=rollout_pb2.WeightHeader(version=3, total_bytes=10))
    assert encode_chunk(header) == header.SerializeToString()
    assert decode_chunk(header.SerializeToString()) == header
    named = rollout_pb2.WeightChunk(shared_file="/dev/shm/x")
    assert decode_chunk(named.SerializeToString()) == named


def test_a_data_field_with_anything_after_it_is_parsed_by_protobuf():
    # A later field (here the oneof's header) wins in protobuf: the fast path must not hide it.
    wire = rollout_pb2.WeightChunk(data=b"abc").SerializeToString()
    wire += rollout_pb2.WeightChunk(header=rollout_pb2.WeightHeader(version=1)).SerializeToString()
    decoded = decode_chunk(wire)
    assert isinstance(decoded, rollout_pb2.WeightChunk) and decoded.WhichOneof("kind") == "header"


@pytest.mark.parametrize("wire", [b"\x12\x05ab", b"\x12\xff\xff", b"\x12"])
def test_a_cut_data_chunk_is_a_decode_error(wire):
    with pytest.raises(DecodeError):
        decode_chunk(wire)
