"""Weight payload files in shared memory: made by a locked owner, removed when done, swept when their maker died.

A payload (a streamed push assembled by a worker, or a learner's `shared_file` push) sits in
RAM-backed /dev/shm while it is loaded. A process killed mid-push cannot remove its file, and a
crash-looping replica would leak the model's size in memory each time. So each process that makes
payload files first makes an owner file and holds an exclusive `flock` on it for as long as it lives
(the kernel drops the lock when the process dies, however it dies), and names its payloads after it.
`sweep_stale` (run when a rollout worker starts) removes every payload whose owner file is gone or
unlocked. Unlike a pid in the name, a lock stays right across pid reuse and pid namespaces
(containers sharing /dev/shm); the lock is on the owner file because writers such as safetensors'
`save_file` replace a payload's inode. The pid is in the names for people only.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

WORKER_PREFIX = "rlep-weights-"  # a worker assembling a streamed push
PUSH_PREFIX = "rlep-push-"  # a learner's payload, streamed or named in a shared_file push
PREFIXES = (WORKER_PREFIX, PUSH_PREFIX)
OWNER_PREFIX = "rlep-owner-"
# An owner file is locked just after it is made: an unlocked one younger than this may be that moment.
OWNER_GRACE_S = 60.0


def default_staging_dir() -> str:
    # Shared memory when there is some: payloads are written once and read once.
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else tempfile.gettempdir()


_owners: dict[Path, str] = {}  # directory -> this process's owner token there (its locked file stays open)
_owners_lock = threading.Lock()


def _owner_token(directory: Path) -> str:
    with _owners_lock:
        if directory not in _owners or os.getpid() != int(_owners[directory].split("-")[0]):
            token = f"{os.getpid()}-{secrets.token_hex(4)}"
            owner = directory / f"{OWNER_PREFIX}{token}"
            fd = os.open(owner, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # never waits: nobody else knows the file; held until this process ends
            atexit.register(owner.unlink, missing_ok=True)  # a killed process's is collected by sweep_stale
            _owners[directory] = token
        return _owners[directory]


@contextmanager
def staged_file(directory: str | Path, prefix: str, suffix: str = ".safetensors") -> Iterator[tuple[int, Path]]:
    """A new file `<prefix><pid>-<owner>-<random><suffix>`, removed when the block ends.

    Yields its open descriptor (write through it, or write the path) and its path.
    """
    directory = Path(directory)
    fd, name = tempfile.mkstemp(prefix=f"{prefix}{_owner_token(directory)}-", suffix=suffix, dir=str(directory))
    path = Path(name)
    try:
        yield fd, path
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def sweep_stale(directories: Iterable[str | Path]) -> list[Path]:
    """Removes the payload files whose maker is gone, and old unlocked owner files; returns the payloads."""
    removed = []
    for directory in dict.fromkeys(Path(d) for d in directories):
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.name.startswith(PREFIXES) and path.is_file() and _ownerless(directory, path.name):
                path.unlink(missing_ok=True)
                removed.append(path)
        for path in directory.glob(f"{OWNER_PREFIX}*"):
            old = time.time() - path.stat().st_mtime > OWNER_GRACE_S
            if old and _unheld(path):
                path.unlink(missing_ok=True)
    if removed:
        log.warning("removed %d weight payload files left by dead processes: %s", len(removed), removed[:5])
    return removed


def _ownerless(directory: Path, name: str) -> bool:
    parts = name.removeprefix(WORKER_PREFIX).removeprefix(PUSH_PREFIX).split("-")
    if len(parts) < 3:
        return False  # not named by staged_file: not ours to judge
    owner = directory / f"{OWNER_PREFIX}{parts[0]}-{parts[1]}"
    return not owner.exists() or _unheld(owner)


def _unheld(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # gone meanwhile
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
