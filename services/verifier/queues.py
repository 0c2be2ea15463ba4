"""Per-worker queues with gold-answer affinity and work stealing (pure logic, no processes).

Items with the same gold answer go to the same worker, so that worker's parse cache parses the gold
answer once for all of a question's G responses. A worker whose own queue is empty takes work from
the tail of the longest other queue whose owner is busy, so a call with one gold answer (or an unlucky
split) still keeps every worker busy. Not from an idle owner's queue: that owner is about to take the
items itself, with the gold answer maybe already parsed. Taking from the tail keeps the owner's head,
and the thief tends to take a run of items of one gold answer (callers send a question's responses
together), so it parses that one once.

Calls share every worker fairly: a worker's queue keeps each call's items apart and takes them round-robin, one
item per call in turn, so a call of one item waits for at most one item of each other call queued there, never for
a whole large batch (issue 31: a call of 40 slow items held three 1-item calls past their 5 s deadlines).

A call does not wait for a worker to start at all: while every worker is busy, `get_express` hands a call's first
item (of a call none of whose queued items has been handed out yet) to the pool's express worker. Round-robin alone
still left a 1-item call waiting for the slow item running on its worker, ~2.6 s of CPU that took over 5 s beside
another test's load (CI, 2 cores).
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


class FairQueue(Generic[T]):
    """Items of several callers: `popleft` serves the callers round-robin, each caller's items in order; `pop` (a
    steal) takes the last item of the caller with the most queued.

    Rounds: a caller served in the current round waits until every other caller has been, and a caller that arrives
    mid-round is served in it, before those already served. Appended behind them instead, a 1-item call waited for
    the running item and then for the next one of the caller that was alone (issue 46: two ~2.6 s items, past a
    5 s deadline). A stream of new calls cannot starve a big one: it is served again once each round.
    """

    def __init__(self):
        # Callers in serving order: those not yet served this round first, then `_served` ones (moved to the end).
        self._callers: collections.OrderedDict[object, collections.deque[T]] = collections.OrderedDict()
        self._served: set[object] = set()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, caller: object, item: T) -> None:
        if caller not in self._callers:
            self._callers[caller] = collections.deque()
            for served in [c for c in self._callers if c in self._served]:  # the newcomer goes before them
                self._callers.move_to_end(served)
        self._callers[caller].append(item)
        self._size += 1

    def callers(self) -> list[object]:
        return list(self._callers)

    def popleft(self) -> tuple[object, T]:
        caller, items = next(iter(self._callers.items()))
        if caller in self._served:  # every caller has been served this round: a new one begins
            self._served.clear()
        item = items.popleft()
        if items:
            self._callers.move_to_end(caller)  # this caller's next item waits for one of every other caller's
            self._served.add(caller)
        else:
            del self._callers[caller]
        self._size -= 1
        return caller, item

    def take(self, caller: object) -> T:
        """`caller`'s first item out of turn (the express worker's pick); its next item keeps the caller's turn."""
        item = self._callers[caller].popleft()
        self._forget_if_empty(caller)
        return item

    def put_back(self, caller: object, items: list[T], last: bool) -> None:
        """Puts a caller's items taken back from a worker before its queued ones; the caller's turn comes next, or
        after every other caller's when `last` (its item was the one that failed)."""
        queued = self._callers.setdefault(caller, collections.deque())
        queued.extendleft(reversed(items))
        self._callers.move_to_end(caller, last=last)
        if last:
            self._served.add(caller)
        else:
            self._served.discard(caller)
        self._size += len(items)

    def pop(self) -> tuple[object, T]:
        caller = max(self._callers, key=lambda c: len(self._callers[c]))
        item = self._callers[caller].pop()
        self._forget_if_empty(caller)
        return caller, item

    def _forget_if_empty(self, caller: object) -> None:
        """After one of `caller`'s items was taken out of turn (`take`, `pop`): a caller with none left leaves."""
        if not self._callers[caller]:
            del self._callers[caller]
            self._served.discard(caller)
        self._size -= 1


class WorkQueues(Generic[T]):
    """One fair queue per worker; `put` routes by gold answer, `get` falls back to stealing, `get_express` takes the
    first item of a call that has not started while every worker is busy."""

    def __init__(self, num_workers: int):
        self._queues: list[FairQueue[T]] = [FairQueue() for _ in range(num_workers)]
        self._cond = threading.Condition()
        self._closed = False
        # Blocked in `get`, waiting for work; True until a worker first asks, so nothing counts it busy before.
        self._idle = [True] * num_workers
        self._queued: collections.Counter[object] = collections.Counter()  # items queued per caller, all queues
        # Callers one of whose queued items has been handed out: not new, so not the express worker's. A caller
        # leaves once it has nothing queued.
        self._started: set[object] = set()

    def worker_for(self, gold: str) -> int:
        """The worker a gold answer belongs to: crc32, not `hash`, so the split is the same in every run."""
        return zlib.crc32(gold.encode("utf-8", "surrogatepass")) % len(self._queues)

    def put(self, items: list[tuple[str, T]], caller: object = None) -> None:
        """Queues (gold, item) pairs of one `caller`, each on its gold answer's worker, in order."""
        with self._cond:
            for gold, item in items:
                self._queues[self.worker_for(gold)].append(caller, item)
            self._queued[caller] += len(items)
            self._cond.notify_all()

    def put_back(self, index: int, items: list[tuple[object, T]], last: object) -> None:
        """Items (caller, item) taken back from worker `index` (replaced with them in its pipe) go back on its queue
        before their callers' queued items; `last` is the caller whose item failed: its turn comes after the others',
        and its items are not the express worker's (they may hang it as they hung this one).
        """
        by_caller: dict[object, list[T]] = {}
        for caller, item in items:
            by_caller.setdefault(caller, []).append(item)
        with self._cond:
            for caller, caller_items in by_caller.items():
                self._queues[index].put_back(caller, caller_items, last=caller is last)
                self._queued[caller] += len(caller_items)
            if last in by_caller:
                self._started.add(last)
            self._cond.notify_all()

    def _handed_out(self, caller: object, queue: FairQueue[T], index: int | None) -> None:
        """Bookkeeping of an item of `caller` taken from `queue` by worker `index` (None: the express worker)."""
        self._queued[caller] -= 1
        if self._queued[caller]:
            self._started.add(caller)
        else:
            del self._queued[caller]
            self._started.discard(caller)
        wake = bool(queue)  # items left: an idle worker may steal them from a busy owner
        if index is not None and self._idle[index]:
            self._idle[index] = False
            wake = True  # the express worker may now see every worker busy
        if wake or (self._closed and not any(self._queues)):
            self._cond.notify_all()

    def get(self, index: int, block: bool) -> T | Closed | None:
        """Worker `index`'s next item, else one stolen from the tail of the longest queue of a busy owner.

        None when nothing is ready and `block` is False; `CLOSED` once closed and nothing is left.
        """
        with self._cond:
            while True:
                own = self._queues[index]
                if own:
                    caller, item = own.popleft()
                    self._handed_out(caller, own, index)
                    return item
                stealable = [q for q, idle in zip(self._queues, self._idle, strict=True) if q and not idle]
                if stealable:
                    queue = max(stealable, key=len)
                    caller, item = queue.pop()
                    self._handed_out(caller, queue, index)
                    return item
                if self._closed and not any(self._queues):
                    self._idle[index] = False
                    return CLOSED
                if not block:
                    return None
                self._idle[index] = True
                self._cond.wait()

    def get_express(self, block: bool) -> T | Closed | None:
        """The first item of a caller none of whose queued items was handed out yet, once no worker is idle (an
        idle one takes it itself); None when there is none and `block` is False; `CLOSED` once closed and empty."""
        with self._cond:
            while True:
                if not any(self._idle):
                    for queue in self._queues:
                        caller = next((c for c in queue.callers() if c not in self._started), None)
                        if caller is not None:
                            item = queue.take(caller)
                            self._handed_out(caller, queue, None)
                            return item
                if self._closed and not any(self._queues):
                    return CLOSED
                if not block:
                    return None
                self._cond.wait()

    def close(self) -> None:
        """Lets `get` return `CLOSED` once every queue is empty; what was queued before is still handed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def sizes(self) -> list[int]:
        with self._cond:
            return [len(q) for q in self._queues]
