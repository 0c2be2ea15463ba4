"""Small file utilities shared by services and commands (no heavy imports)."""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Callable
from pathlib import Path

# Hashed in slices of a memory map: no read copies, and a slice stays in cache while it is hashed.
HASH_BLOCK_BYTES = 8 * 1024 * 1024


def _xxh3_128():
    import xxhash

    return xxhash.xxh3_128()


# Digest algorithms by name -> a new hashlib-style hasher (update, hexdigest). Measured on one core of a
# 2-core box over 416 MB in memory: sha256 (SHA-NI) 1.46 GB/s, blake2b 0.91, blake3 4.4, xxh3_128 12 GB/s.
HASHERS: dict[str, Callable] = {"sha256": hashlib.sha256, "xxh3_128": _xxh3_128}


class TokenFileError(ValueError):
    """A token file that is missing, unreadable or empty: the user's mistake (the CLI reports it in one line)."""


def read_token_file(path: Path | None) -> str | None:
    """The bearer token in `path` (one line, surrounding whitespace ignored), or None without a file.

    Every service, client and command reads token files through this, so an empty file is an error everywhere.
    """
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise TokenFileError(f"auth token file {path}: {(err.strerror or str(err)).lower()}") from err
    if not token:
        raise TokenFileError(f"auth token file {path} is empty")
    return token


def load_safetensors(paths: list[Path]) -> dict:
    """One state dict from safetensors files (never unpickled), later files overriding earlier keys."""
    from safetensors.torch import load_file

    state: dict = {}
    for path in paths:
        state.update(load_file(str(path)))
    return state


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes with one of `HASHERS` (weights payloads and checkpoints are GBs)."""
    digest = HASHERS[algorithm]()
    with Path(path).open("rb") as f:
        if Path(path).stat().st_size == 0:  # mmap refuses an empty file
            return digest.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, len(view), HASH_BLOCK_BYTES):
                    digest.update(view[start : start + HASH_BLOCK_BYTES])
            finally:
                view.release()  # the map cannot close while a view of it is alive
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return file_digest(path, "sha256")
