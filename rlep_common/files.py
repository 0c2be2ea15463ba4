"""Small file utilities shared by services and commands (no heavy imports)."""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH_BLOCK_BYTES = 8 * 1024 * 1024  # large reads: hashing runs at memory speed, not syscall speed


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks (weights payloads and checkpoints are GBs)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()
