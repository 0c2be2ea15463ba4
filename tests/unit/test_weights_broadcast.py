"""The broadcast weight path's manifest and group (pure logic; tests/integration/test_weights_broadcast.py runs it)."""

import pytest
import torch

from rlep.services.weights.broadcast import BroadcastGroup, manifest, manifest_bytes, manifest_digest, rank_offsets
from rlep.services.weights.payload import TensorInfo


def test_manifest_lists_tensors_in_order_with_safetensors_dtypes():
    state = {"b": torch.zeros(2, 3), "a": torch.zeros(4, dtype=torch.bfloat16)}
    assert manifest(state) == [("b", TensorInfo("F32", (2, 3))), ("a", TensorInfo("BF16", (4,)))]
    assert manifest_bytes(manifest(state)) == 2 * 3 * 4 + 4 * 2


def test_digest_changes_with_any_name_shape_dtype_or_order():
    entries = manifest({"a": torch.zeros(2), "b": torch.zeros(3)})
    digest = manifest_digest(entries)
    assert digest == manifest_digest(manifest({"a": torch.ones(2), "b": torch.ones(3)}))  # values don't matter
    variants = [
        manifest({"b": torch.zeros(3), "a": torch.zeros(2)}),
        manifest({"a": torch.zeros(2), "c": torch.zeros(3)}),
        manifest({"a": torch.zeros(2), "b": torch.zeros(4)}),
        manifest({"a": torch.zeros(2), "b": torch.zeros(3, dtype=torch.float16)}),
    ]
    assert len({digest, *(manifest_digest(v) for v in variants)}) == 5


def test_unsupported_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="int64"):
        manifest({"steps": torch.zeros(1, dtype=torch.int64)})


def test_rank_offsets_leave_rank_zero_to_the_learner():
    assert rank_offsets([1, 1, 1]) == [1, 2, 3]
    assert rank_offsets([4, 4]) == [1, 5]
    assert rank_offsets([2, 1, 4]) == [1, 3, 4]  # replicas of different tensor-parallel sizes


def test_a_group_names_a_known_backend():
    assert BroadcastGroup("h", 1, 2).backend == "nccl"
    with pytest.raises(ValueError, match="'nccl', 'gloo'"):
        BroadcastGroup("h", 1, 2, backend="mpi")
