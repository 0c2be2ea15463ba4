"""rlep.common.files: the one reader of token files and of safetensors checkpoints."""

from __future__ import annotations

import hashlib

import pytest
import torch
import xxhash

from rlep.common import files
from rlep.common.files import file_digest, load_safetensors, read_token_file, sha256_file


def test_token_files_are_one_stripped_line_and_never_empty(tmp_path):
    token = tmp_path / "token"
    token.write_text("  s3cret \n")
    assert read_token_file(token) == "s3cret"
    assert read_token_file(None) is None
    token.write_text(" \n")
    with pytest.raises(ValueError, match=f"auth token file {token} is empty"):
        read_token_file(token)


def test_safetensors_files_merge_into_one_state_dict(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2), "b": torch.ones(1)}, str(tmp_path / "1.safetensors"))
    save_file({"b": torch.full((1,), 7.0)}, str(tmp_path / "2.safetensors"))
    state = load_safetensors(sorted(tmp_path.glob("*.safetensors")))
    assert sorted(state) == ["a", "b"] and state["a"].tolist() == [0.0, 0.0] and state["b"].tolist() == [7.0]


@pytest.mark.parametrize("size", [0, 1, 7, 20, 64])
def test_file_digests_equal_the_digest_of_the_bytes(tmp_path, monkeypatch, size):
    monkeypatch.setattr(files, "HASH_BLOCK_BYTES", 7)  # several slices, and a short last one
    data = bytes(range(size))
    path = tmp_path / "f"
    path.write_bytes(data)
    assert sha256_file(path) == file_digest(path, "sha256") == hashlib.sha256(data).hexdigest()
    assert file_digest(path, "xxh3_128") == xxhash.xxh3_128(data).hexdigest()
