"""Reading DeepSpeed checkpoints back in tests: a tag directory's model and optimizer states, compared as trees."""

from __future__ import annotations

from pathlib import Path

import torch


def deepspeed_state(tag_dir: Path) -> tuple[dict, dict]:
    """(model states, optimizer states) of a single-process DeepSpeed checkpoint directory."""
    (model_file,) = tag_dir.glob("mp_rank_*_model_states.pt")
    (optim_file,) = tag_dir.glob("*_optim_states.pt")
    return torch.load(model_file, weights_only=False), torch.load(optim_file, weights_only=False)


def assert_same_tree(a, b, path: str = "") -> int:
    """Tensors equal within float tolerance and numbers equal, recursively; returns how many tensors were compared."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{path}: {m}")
        return 1
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        return sum(assert_same_tree(a[k], b[k], f"{path}/{k}") for k in a)
    if isinstance(a, list | tuple):
        assert len(a) == len(b), path
        return sum(assert_same_tree(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True)))
    if isinstance(a, int | float | bool):
        assert a == b, f"{path}: {a} != {b}"
    return 0
