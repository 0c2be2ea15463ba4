"""Weight payload checks: what a push must contain before any engine sees it."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from rlep.common.files import file_digest, sha256_file
from rlep.services.weights.payload import (
    PAYLOAD_DIGEST,
    SAFETENSORS_DTYPES,
    TensorInfo,
    WeightError,
    WeightSpec,
    payload_of,
    read_header,
    write_payload,
)

SPEC = WeightSpec(
    {"embed.weight": TensorInfo("F32", (8, 4)), "norm.weight": TensorInfo("F32", (4,))},
    ignorable=frozenset({"lm_head.weight"}),
)


def test_payload_header_round_trip(tmp_path):
    path = tmp_path / "w.safetensors"
    state = {"embed.weight": torch.ones(8, 4), "norm.weight": torch.zeros(4)}
    assert write_payload(state, path, "sha256") == sha256_file(path)
    digest = write_payload(state, path)  # the default: what a push's header carries
    assert PAYLOAD_DIGEST == "xxh3_128" and digest == file_digest(path, "xxh3_128") and len(digest) == 32
    header = read_header(path)
    assert header == {"embed.weight": TensorInfo("F32", (8, 4)), "norm.weight": TensorInfo("F32", (4,))}
    SPEC.check(header)  # fits: no exception


def test_a_floating_tensor_may_come_in_the_engines_dtype_and_no_other():
    import dataclasses

    bf16_engine = dataclasses.replace(SPEC, engine_dtype="BF16")
    bf16_engine.check({name: TensorInfo("BF16", info.shape) for name, info in SPEC.tensors.items()})
    with pytest.raises(WeightError, match="norm.weight: dtype F16, expected F32 or BF16"):
        bf16_engine.check({**SPEC.tensors, "norm.weight": TensorInfo("F16", (4,))})


def test_tied_output_layer_may_be_sent_or_not():
    SPEC.check({**SPEC.tensors, "lm_head.weight": TensorInfo("F32", (8, 4))})


@pytest.mark.parametrize(
    ("pushed", "message"),
    [
        ({"embed.weight": TensorInfo("F32", (8, 4))}, "missing 1 tensors (e.g. norm.weight)"),
        ({**SPEC.tensors, "extra.bias": TensorInfo("F32", (1,))}, "unknown tensors extra.bias"),
        ({**SPEC.tensors, "norm.weight": TensorInfo("F32", (5,))}, "norm.weight: shape [5], expected [4]"),
        ({**SPEC.tensors, "norm.weight": TensorInfo("BF16", (4,))}, "norm.weight: dtype BF16, expected F32"),
    ],
)
def test_spec_names_every_problem(pushed, message):
    with pytest.raises(WeightError, match="do not fit the model") as info:
        SPEC.check(pushed)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "content",
    [
        b"abc",  # shorter than the length prefix
        struct.pack("<Q", 10**12) + b"{}",  # header length beyond the file
        struct.pack("<Q", 5) + b"{nope",  # not JSON
        struct.pack("<Q", 2) + b"[]",  # JSON, not an object
        struct.pack("<Q", 17) + b'{"a": {"x": 1}} ',  # entry without dtype/shape
    ],
)
def test_junk_is_not_a_payload(tmp_path, content):
    path = tmp_path / "junk"
    path.write_bytes(content)
    with pytest.raises(WeightError, match="not a safetensors payload"):
        read_header(path)


def test_spec_from_a_checkpoint_directory(tmp_path):
    write_payload({"embed.weight": torch.ones(8, 4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    spec = WeightSpec.from_checkpoint(tmp_path)
    assert spec.tensors == {"embed.weight": TensorInfo("F32", (8, 4))}
    assert spec.ignorable == {"lm_head.weight"}


STATES = {
    "dtypes": {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False]),
    },
    "odd shapes": {"scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "transposed": torch.randn(4, 6).t()},
    "shared storage": {"embed": (w := torch.randn(5, 3)), "head": w},  # a tied output layer
}


@pytest.mark.parametrize("name", STATES)
def test_payloads_written_from_tensor_memory_are_safetensors_files(tmp_path, name):
    """Written and streamed by our own writer: safetensors must read back every tensor exactly."""
    from safetensors.torch import load_file

    state, path = STATES[name], tmp_path / "w.safetensors"
    digest = write_payload(state, path)
    assert digest == file_digest(path, PAYLOAD_DIGEST) == payload_of(state).digest()
    assert path.read_bytes() == b"".join(bytes(block) for block in payload_of(state).blocks(3))
    loaded = load_file(str(path))
    assert loaded.keys() == state.keys()
    for key, tensor in state.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    assert read_header(path) == {k: TensorInfo(SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)) for k, t in state.items()}
