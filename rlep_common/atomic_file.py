"""Files replaced whole or not at all: a power cut or a kill midway leaves the old file or the new one, never part.

The bytes go to a temporary file beside the target, are fsynced, renamed over it, and the directory is fsynced so
the rename itself survives a cut. Used for what a cut must not leave empty or half written: the embedded Redis's
password and config, exported pool files.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_write(path: Path, mode: int) -> Iterator[BinaryIO]:
    """Yields a binary file that replaces `path` when the block ends without an error (deleted otherwise).

    `mode` is the file's permission bits; the temporary file is 0600 from its creation (never briefly wider) and
    gets `mode` before anything is written. Its name, `.<name>.<random>.partial`, is hidden beside `path`.
    """
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)
