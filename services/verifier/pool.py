"""A pool of verifier worker processes with a hard per-item timeout.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot kill one hung worker; a single
pathological answer (sympy stuck in C code, where math-verify's `signal.alarm` never fires) would
stall or break the whole pool. Here each worker process is owned by one dispatcher thread that
sends it one item at a time over a pipe, waits at most `item_timeout_s`, and on a timeout or a
crash kills and replaces that process. Only the item in flight is affected: it gets TIMEOUT or
ERROR, and every other item of the batch is checked as usual.

Only our own processes on this host exchange pickled data over these pipes; nothing from the
network is unpickled (the gRPC layer hands us plain strings).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import resource
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from multiprocessing.connection import Connection

from rlep_common.types import Verdict
from services.verifier.core import CheckOptions, CheckResult, check_answer

log = logging.getLogger(__name__)

# A fresh worker imports math-verify, sympy and antlr (1-3 s); allow for a loaded machine.
WORKER_START_TIMEOUT_S = 60.0
_READY = "ready"
# Items sent to a worker per round trip: fewer wake-ups and pipe writes for cheap items, while a
# hung item still costs only itself (the rest of its chunk is re-sent to the replacement worker).
CHUNK_ITEMS = 8


def _worker_main(conn: Connection, options: CheckOptions, memory_limit_mb: int) -> None:
    """Runs in the worker process: answer (response, ground_truth) pairs until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    if memory_limit_mb > 0:  # a runaway sympy expansion gets MemoryError, not the host's OOM killer
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import math_verify  # noqa: F401 - pay the import before reporting ready

    conn.send(_READY)
    while True:
        try:
            chunk = conn.recv()  # a list of (response, ground_truth)
        except (EOFError, OSError):
            return
        for response, ground_truth in chunk:
            try:
                result = check_answer(response, ground_truth, options)
            except BaseException:  # MemoryError & co: the item failed, the worker lives on
                result = CheckResult(Verdict.ERROR, "")
            conn.send(result)  # one reply per item, so the parent times each item on its own


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

    def check(self, items: Sequence[tuple[str, str]], timeout_s: float) -> tuple[list[CheckResult], str | None]:
        """Checks `items` in order, allowing `timeout_s` for each.

        Returns the results of the items answered before the worker stopped (all of them when it
        stays healthy) and a restart reason, "timeout" or "crash", when it stopped at the next one.
        """
        results: list[CheckResult] = []
        try:
            self.conn.send(list(items))
            for _ in items:
                if not self.conn.poll(timeout_s):
                    return results, "timeout"
                results.append(self.conn.recv())
        except (EOFError, OSError):
            return results, "crash"
        return results, None


_Task = tuple[str, str, Future]


class VerifyPool:
    """Checks (response, ground_truth) pairs on `num_workers` processes.

    Args:
        num_workers: worker processes (one per core is the sweet spot: the work is CPU-bound).
        item_timeout_s: hard limit for one item in a worker; past it the worker is replaced.
        options: limits passed to `check_answer`.
        memory_limit_mb: address-space limit of each worker (0 = none).
        on_restart: called with "timeout" or "crash" each time a worker is replaced (metrics).
    """

    def __init__(
        self,
        num_workers: int,
        item_timeout_s: float,
        options: CheckOptions = CheckOptions(),
        memory_limit_mb: int = 0,
        on_restart: Callable[[str], None] | None = None,
    ):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.item_timeout_s = item_timeout_s
        self._on_restart = on_restart or (lambda reason: None)
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        # spawn, not fork: the parent runs gRPC threads, and forking a threaded process is unsafe.
        ctx = mp.get_context("spawn")
        self._workers = [_Worker(ctx, options, memory_limit_mb) for _ in range(num_workers)]
        self._threads = [
            threading.Thread(target=self._dispatch, args=(w,), name=f"verify-{i}", daemon=True)
            for i, w in enumerate(self._workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def _take_tasks(self) -> list[_Task] | None:
        """Blocks for one task, then takes up to CHUNK_ITEMS - 1 more that are already queued."""
        first = self._tasks.get()
        if first is None:
            return None
        tasks = [first]
        while len(tasks) < CHUNK_ITEMS:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is None:  # another dispatcher's stop signal: hand it on
                self._tasks.put(None)
                break
            tasks.append(task)
        return tasks

    def _dispatch(self, worker: _Worker) -> None:
        while (tasks := self._take_tasks()) is not None:
            pending = [t for t in tasks if t[2].set_running_or_notify_cancel()]
            retried = False
            while pending:
                if not worker.process.is_alive():  # died while idle: not the next item's fault
                    self._replace(worker, "crash")
                results, reason = worker.check([(r, g) for r, g, _ in pending], self.item_timeout_s)
                for (_, _, future), result in zip(pending, results, strict=False):
                    future.set_result(result)
                pending = pending[len(results) :]
                if results:  # the retried item (if any) is done: a later crash earns its own retry
                    retried = False
                if reason is None:
                    break
                self._replace(worker, reason)
                # A timeout is the item's doing; a crash may be the host's, so it gets one retry.
                if reason == "timeout" or retried:
                    verdict = Verdict.TIMEOUT if reason == "timeout" else Verdict.ERROR
                    pending.pop(0)[2].set_result(CheckResult(verdict, "", self.item_timeout_s))
                    retried = False
                else:
                    retried = True
        worker.kill()

    def _replace(self, worker: _Worker, reason: str) -> None:
        log.warning("verifier worker %s: %s; replacing it", worker.process.pid, reason)
        self._restart(worker)
        self._on_restart(reason)

    @staticmethod
    def _restart(worker: _Worker) -> None:
        while True:  # a worker that fails to start (e.g. fork limits) is retried, never abandoned
            try:
                worker.restart()
                return
            except (RuntimeError, OSError) as err:
                log.error("could not restart a verifier worker (%s); retrying", err)
                time.sleep(1.0)

    def submit(self, response: str, ground_truth: str) -> Future:
        future: Future = Future()
        self._tasks.put((response, ground_truth, future))
        return future

    def verify(self, items: Sequence[tuple[str, str]], timeout_s: float | None = None) -> list[CheckResult]:
        """Checks every item; results in order. Raises TimeoutError if `timeout_s` runs out first."""
        futures = [self.submit(response, gold) for response, gold in items]
        _, pending = wait(futures, timeout=timeout_s)
        if pending:
            for future in pending:
                future.cancel()  # queued items are skipped; the ones running finish on their own
            raise TimeoutError(f"{len(pending)} of {len(futures)} items unfinished after {timeout_s}s")
        return [f.result() for f in futures]

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
