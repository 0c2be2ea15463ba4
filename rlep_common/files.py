"""Small file utilities shared by services and commands (no heavy imports)."""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH_BLOCK_BYTES = 8 * 1024 * 1024  # large reads: hashing runs at memory speed, not syscall speed


def read_token_file(path: Path | None) -> str | None:
    """The bearer token in `path` (one line, surrounding whitespace ignored), or None without a file.

    Every service, client and command reads token files through this, so an empty file is an error everywhere.
    """
    if path is None:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token


def load_safetensors(paths: list[Path]) -> dict:
    """One state dict from safetensors files (never unpickled), later files overriding earlier keys."""
    from safetensors.torch import load_file

    state: dict = {}
    for path in paths:
        state.update(load_file(str(path)))
    return state


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks (weights payloads and checkpoints are GBs)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()
