"""Stale JIT-build locks, cleared before a learner process loads DeepSpeed's ops.

torch.utils.cpp_extension guards each extension's build folder with a `FileBaton`: a file named `lock` created with
O_CREAT|O_EXCL, held open by the process that builds (or merely re-checks, which every new process does: DeepSpeed's
CPU backend loads `deepspeed_shm_comm` in each learner's `init_distributed`), removed when it is done. Anyone who
finds the file waits for it to vanish, polling, with no bound. A process killed inside that window (a learner
SIGKILLed while starting, a machine's jobs ended at a session's stop) leaves the file behind, and from then on every
learner on the machine hangs at start, silently and for ever.

A live holder keeps the file open, so a `lock` that no process has open is stale: it is removed, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

BATON_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in each extension's build folder


def torch_extensions_root() -> Path:
    """Where torch JIT-builds extensions: TORCH_EXTENSIONS_DIR, else its default cache folder."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def _open_inodes() -> set[tuple[int, int]]:
    """(device, inode) of every file some process on this machine has open (those we may look at)."""
    held: set[tuple[int, int]] = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):  # processes come and go; others' fds may be unreadable
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    info = fd.stat()
                    held.add((info.st_dev, info.st_ino))
    return held


def clear_stale_jit_locks(root: Path | None = None) -> list[Path]:
    """Removes the build locks under `root` (default: torch's extensions folder) that no live process holds;
    returns them. Does nothing where /proc cannot tell who holds a file (not Linux)."""
    root = root if root is not None else torch_extensions_root()
    if not sys.platform.startswith("linux") or not root.is_dir():
        return []
    # <root>/<extension>/lock with TORCH_EXTENSIONS_DIR set, <root>/<py311_cpu>/<extension>/lock without.
    batons = [*root.glob(f"*/{BATON_NAME}"), *root.glob(f"*/*/{BATON_NAME}")]
    if not batons:
        return []
    held = _open_inodes()
    cleared = []
    for baton in batons:
        with contextlib.suppress(FileNotFoundError):  # released meanwhile: nothing to do
            info = baton.stat()
            if (info.st_dev, info.st_ino) in held:
                continue  # a live process is building or checking this extension
            again = baton.stat()
            if (again.st_dev, again.st_ino) != (info.st_dev, info.st_ino):
                continue  # released and taken again since we looked: the new one is live
            baton.unlink()
            cleared.append(baton)
            log.warning(
                "removed %s: a JIT-build lock left by a process that died while holding it (every later load "
                "of that extension would have waited for it for ever)",
                baton,
            )
    return cleared
