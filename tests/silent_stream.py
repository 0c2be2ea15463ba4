"""A request iterator that sends nothing until released: a gRPC call opened and left idle (its headers go out, no
message follows), as a stuck or hostile client leaves it."""

from __future__ import annotations

import threading


class Silent:
    """Sends nothing until `release` is set, then ends (still having sent nothing)."""

    def __init__(self, release: threading.Event):
        self._release = release

    def __iter__(self):
        return self

    def __next__(self):
        self._release.wait()
        raise StopIteration
