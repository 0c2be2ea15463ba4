"""rlep.common.files: the one reader of token files and of safetensors checkpoints."""

from __future__ import annotations

import pytest
import torch

from rlep.common.files import load_safetensors, read_token_file


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
