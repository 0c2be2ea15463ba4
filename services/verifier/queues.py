"""Per-worker queues with gold-answer affinity and work stealing (pure logic, no processes).

Items with the same gold answer go to the same worker, so that worker's parse cache parses the gold
answer once for all of a question's G responses. A worker whose own queue is empty takes work from
the tail of the longest other queue whose owner is busy, so a call with one gold answer (or an unlucky
split) still keeps every worker busy. Not from an idle owner's queue: that owner is about to take the
items itself, with the gold answer maybe already parsed. Taking from the tail keeps the owner's head,
and the thief tends to take a run of items of one gold answer (callers send a question's responses
together), so it parses that one once.
"""

from __future__ import annotations

import collections
import threading
import zlib
from typing import Generic, TypeVar

T = TypeVar("T")


class Closed:
    """Returned by `get` once the queues are closed and empty."""


CLOSED = Closed()


class WorkQueues(Generic[T]):
    """One FIFO per worker; `put` routes by gold answer, `get` falls back to stealing."""

    def __init__(self, num_workers: int):
        self._queues: list[collections.deque[T]] = [collections.deque() for _ in range(num_workers)]
        self._cond = threading.Condition()
        self._closed = False
        self._idle = [False] * num_workers  # blocked in `get`, waiting for work

    def worker_for(self, gold: str) -> int:
        """The worker a gold answer belongs to: crc32, not `hash`, so the split is the same in every run."""
        return zlib.crc32(gold.encode("utf-8", "surrogatepass")) % len(self._queues)

    def put(self, items: list[tuple[str, T]]) -> None:
        """Queues (gold, item) pairs, each on its gold answer's worker, in order."""
        with self._cond:
            for gold, item in items:
                self._queues[self.worker_for(gold)].append(item)
            self._cond.notify_all()

    def get(self, index: int, block: bool) -> T | Closed | None:
        """Worker `index`'s next item, else one stolen from the tail of the longest queue of a busy owner.

        None when nothing is ready and `block` is False; `CLOSED` once closed and nothing is left.
        """
        with self._cond:
            while True:
                own = self._queues[index]
                if own:
                    self._idle[index] = False
                    item = own.popleft()
                    if own:  # items left: idle workers may now steal them from a busy owner
                        self._cond.notify_all()
                    return item
                stealable = [q for q, idle in zip(self._queues, self._idle, strict=True) if q and not idle]
                if stealable:
                    self._idle[index] = False
                    return max(stealable, key=len).pop()
                if self._closed and not any(self._queues):
                    self._idle[index] = False
                    return CLOSED
                if not block:
                    return None
                self._idle[index] = True
                self._cond.wait()

    def close(self) -> None:
        """Lets `get` return `CLOSED` once every queue is empty; what was queued before is still handed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def sizes(self) -> list[int]:
        with self._cond:
            return [len(q) for q in self._queues]
