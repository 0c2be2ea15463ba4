"""A pool of verifier worker processes with a hard per-item timeout and per-request cancellation.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot kill one hung worker; a single
pathological answer (sympy stuck in C code, where no signal handler runs) would stall or break the
whole pool. Here each worker process is owned by one dispatcher thread that keeps at most `WINDOW`
items in the worker's pipe, waits at most `item_timeout_s` for each answer, and on a timeout or a
crash kills and replaces that process. Only the item at the head is blamed: it gets TIMEOUT (or,
after a second crash, ERROR); the items sent behind it are sent again to the replacement.

A verify call is a `VerifyBatch`. Cancelling it (the caller gave up, or its deadline passed) makes
the dispatchers drop its items that are not yet in a worker's pipe; at most `WINDOW` items per
worker that were already sent still run (each bounded by `item_timeout_s`).

Only our own processes on this host exchange pickled data over these pipes; nothing from the
network is unpickled (the gRPC layer hands us plain strings).
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import queue
import resource
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass
from multiprocessing.connection import Connection

from rlep.common.types import Verdict
from rlep.services.verifier.core import CheckOptions, CheckResult, check_answer

log = logging.getLogger(__name__)

# A fresh worker imports math-verify, sympy and antlr (1-3 s); allow for a loaded machine.
WORKER_START_TIMEOUT_S = 60.0
_READY = "ready"
# Items in one worker's pipe at a time: the next ones wait there while one runs, so the worker does not
# idle while its dispatcher thread waits to be scheduled (on a loaded host a window of 2 measured slower
# than 4), and a cancelled request still costs at most this many items per worker.
WINDOW = 4
# Checked before a worker reports ready, so the lazy imports of a first check (~0.06 s of CPU) are not
# billed to a real item's CPU limit.
WARMUP_ITEMS = (("\\boxed{\\frac{1}{2}+\\sqrt{2}}", "0.5+\\sqrt{2}"), ("\\boxed{\\sum_{k=1}^{3} k}", "6"))


def _worker_main(conn: Connection, options: CheckOptions, memory_limit_mb: int) -> None:
    """Runs in the worker process: answer (response, ground_truth) pairs until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    if memory_limit_mb > 0:  # a runaway sympy expansion gets MemoryError, not the host's OOM killer
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for name in ("math_verify.parser", "math_verify.grader"):  # "you must provide the timeout yourself": we do
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))
    for response, ground_truth in WARMUP_ITEMS:
        check_answer(response, ground_truth, options)
    conn.send(_READY)
    while True:
        try:
            response, ground_truth = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = check_answer(response, ground_truth, options)
        except BaseException:  # MemoryError & co: the item failed, the worker lives on
            result = CheckResult(Verdict.ERROR, "")
        conn.send(result)


class _Worker:
    """One worker process and its pipe; restarted in place after a timeout or crash."""

    def __init__(self, ctx: mp.context.BaseContext, options: CheckOptions, memory_limit_mb: int):
        self._ctx, self._options, self._memory_limit_mb = ctx, options, memory_limit_mb
        self._start()

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self.process = self._ctx.Process(
            target=_worker_main, args=(child, self._options, self._memory_limit_mb), daemon=True
        )
        self.process.start()
        child.close()
        self.conn = parent
        if not parent.poll(WORKER_START_TIMEOUT_S) or parent.recv() != _READY:
            raise RuntimeError("verifier worker did not start")

    def restart(self) -> None:
        self.kill()
        self._start()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class VerifyBatch:
    """The items of one verify call: results by position, and a cancelled flag the dispatchers read."""

    def __init__(self, size: int):
        self.size = size
        self.results: list[CheckResult | None] = [None] * size
        self.cancelled = False
        self._remaining = size
        self._lock = threading.Lock()
        self._finished = threading.Event()
        if size == 0:
            self._finished.set()

    def set_result(self, index: int, result: CheckResult) -> None:
        with self._lock:
            self.results[index] = result
            self._remaining -= 1
            if self._remaining == 0:
                self._finished.set()

    def cancel(self) -> None:
        """Drops the items not yet sent to a worker; a no-op once every item is answered."""
        self.cancelled = True
        self._finished.set()

    def wait(self, timeout_s: float | None = None) -> list[CheckResult]:
        """Results in order. Raises TimeoutError when `timeout_s` runs out, CancelledError when cancelled."""
        self._finished.wait(timeout_s)
        with self._lock:
            if self._remaining == 0:
                return list(self.results)  # type: ignore[arg-type]
            if self.cancelled:
                raise CancelledError(f"{self._remaining} of {self.size} items dropped: the request was cancelled")
            raise TimeoutError(f"{self._remaining} of {self.size} items unfinished after {timeout_s}s")


@dataclass
class _Task:
    batch: VerifyBatch
    index: int
    response: str
    ground_truth: str


_STOP = object()  # one per dispatcher thread, queued by close()


class VerifyPool:
    """Checks (response, ground_truth) pairs on `num_workers` processes.

    Args:
        num_workers: worker processes (one per core is the sweet spot: the work is CPU-bound).
        item_timeout_s: hard wall-clock limit for one item in a worker; past it the worker is replaced.
        options: limits passed to `check_answer`.
        memory_limit_mb: address-space limit of each worker (0 = none).
        on_restart: called with "timeout" or "crash" each time a worker is replaced (metrics).
        on_skip: called once for each item dropped unchecked because its batch was cancelled (metrics).
    """

    def __init__(
        self,
        num_workers: int,
        item_timeout_s: float,
        options: CheckOptions = CheckOptions(),
        memory_limit_mb: int = 0,
        on_restart: Callable[[str], None] | None = None,
        on_skip: Callable[[], None] | None = None,
    ):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.item_timeout_s = item_timeout_s
        self._on_restart = on_restart or (lambda reason: None)
        self._on_skip = on_skip or (lambda: None)
        self._tasks: queue.SimpleQueue[_Task | object] = queue.SimpleQueue()
        self._counts_lock = threading.Lock()
        # checked: answers from workers; skipped: dropped as cancelled; resent: in a worker's pipe when it
        # was replaced, so sent again. Per worker: answers from each worker slot.
        self._counts = {"checked": 0, "skipped": 0, "resent": 0}
        self._checked_by_worker = [0] * num_workers
        self._busy = [threading.Event() for _ in range(num_workers)]
        # spawn, not fork: the parent runs gRPC threads, and forking a threaded process is unsafe.
        ctx = mp.get_context("spawn")
        self._workers = [_Worker(ctx, options, memory_limit_mb) for _ in range(num_workers)]
        self._threads = [
            threading.Thread(target=self._dispatch, args=(i,), name=f"verify-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def counts(self) -> dict[str, int | list[int]]:
        """Work done so far: items checked (in total and per worker slot), skipped and re-sent."""
        with self._counts_lock:
            return {**self._counts, "checked_by_worker": list(self._checked_by_worker)}

    def wait_busy(self, worker_index: int, timeout_s: float) -> bool:
        """Blocks until that worker has an item in its pipe or running; False if `timeout_s` passes first.

        The flag drops before the result of a worker's last item is set, so after a call returns this
        waits for the next call's items, not the finished call's.
        """
        return self._busy[worker_index].wait(timeout_s)

    def _count(self, key: str, n: int = 1, worker_index: int | None = None) -> None:
        with self._counts_lock:
            self._counts[key] += n
            if worker_index is not None:
                self._checked_by_worker[worker_index] += n

    def _next_task(self, resend: collections.deque[_Task], block: bool, use_queue: bool) -> _Task | object | None:
        """The next item of a live batch (taken-back items first), `_STOP`, or None when none is ready."""
        while True:
            if resend:
                task = resend.popleft()
            elif not use_queue:
                return None
            else:
                try:
                    task = self._tasks.get() if block else self._tasks.get_nowait()
                except queue.Empty:
                    return None
                if task is _STOP:
                    return _STOP
            if not task.batch.cancelled:
                return task
            self._count("skipped")
            self._on_skip()

    def _dispatch(self, index: int) -> None:
        worker, busy = self._workers[index], self._busy[index]
        sent: collections.deque[_Task] = collections.deque()  # in the worker's pipe, in order
        resend: collections.deque[_Task] = collections.deque()  # taken back from a replaced worker
        head_since = 0.0  # when the head item of `sent` started running
        retried: _Task | None = None  # the item that already caused one crash
        stopping = False  # this thread took its stop signal: it finishes what it holds, takes nothing new
        while True:
            while len(sent) < WINDOW:
                task = self._next_task(resend, block=not sent, use_queue=not stopping)
                if task is _STOP:
                    stopping = True
                    continue
                if task is None:
                    break
                if not sent and not worker.process.is_alive():  # died while idle: no item's fault
                    self._replace(worker, "crash")
                try:
                    worker.conn.send((task.response, task.ground_truth))
                except OSError:  # died with items in its pipe: the receive below blames the head
                    resend.appendleft(task)
                    break
                if not sent:
                    head_since = time.monotonic()
                    busy.set()
                sent.append(task)
            if not sent:
                if resend:  # the worker died between the idle check and the send
                    self._replace(worker, "crash")
                    continue
                break  # stopping, and nothing left to do
            reason = self._receive(worker, sent, head_since, index)
            if reason is None:
                head_since = time.monotonic()  # the next item was already in the pipe
                continue
            head = sent[0]
            busy.clear()  # before any result is set: a caller that saw its result sees the flag down
            self._replace(worker, reason)
            self._count("resent", len(sent) - 1)
            # A timeout is the item's doing; a crash may be the host's, so the head gets one retry.
            if reason == "timeout" or head is retried:
                sent.popleft()
                verdict = Verdict.TIMEOUT if reason == "timeout" else Verdict.ERROR
                head.batch.set_result(head.index, CheckResult(verdict, "", self.item_timeout_s))
            else:
                retried = head
                self._count("resent")
            resend.extendleft(reversed(sent))
            sent.clear()
        busy.clear()
        worker.kill()

    def _receive(self, worker: _Worker, sent: collections.deque[_Task], head_since: float, index: int) -> str | None:
        """Waits for the head item's answer; None when it came, else "timeout" or "crash"."""
        try:
            if not worker.conn.poll(max(0.0, self.item_timeout_s - (time.monotonic() - head_since))):
                return "timeout"
            result = worker.conn.recv()
        except (EOFError, OSError):
            return "crash"
        task = sent.popleft()
        if not sent:
            self._busy[index].clear()  # before the result is set (see `wait_busy`)
        task.batch.set_result(task.index, result)
        self._count("checked", worker_index=index)
        return None

    def _replace(self, worker: _Worker, reason: str) -> None:
        log.warning("verifier worker %s: %s; replacing it", worker.process.pid, reason)
        while True:  # a worker that fails to start (e.g. fork limits) is retried, never abandoned
            try:
                worker.restart()
                break
            except (RuntimeError, OSError) as err:
                log.error("could not restart a verifier worker (%s); retrying", err)
                time.sleep(1.0)
        self._on_restart(reason)

    def start(self, items: Sequence[tuple[str, str]]) -> VerifyBatch:
        """Queues every item; wait on (or cancel) the returned batch."""
        batch = VerifyBatch(len(items))
        for i, (response, gold) in enumerate(items):
            self._tasks.put(_Task(batch, i, response, gold))
        return batch

    def verify(self, items: Sequence[tuple[str, str]], timeout_s: float | None = None) -> list[CheckResult]:
        """Checks every item; results in order. Raises TimeoutError if `timeout_s` runs out first."""
        batch = self.start(items)
        try:
            return batch.wait(timeout_s)
        finally:
            batch.cancel()  # after a timeout: the unsent items are dropped, not checked for nobody

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put(_STOP)
        for thread in self._threads:
            thread.join(timeout=10)
