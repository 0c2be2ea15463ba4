"""A pool of verifier worker processes: hard per-item timeouts, per-request cancellation, no repeated work.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot kill one hung worker; a single
pathological answer (sympy stuck in C code, where no signal handler runs) would stall or break the
whole pool. Here each worker process is owned by one dispatcher thread that keeps at most `WINDOW`
items in the worker's pipe, waits at most `item_timeout_s` for each answer, and on a timeout or a
crash kills and replaces that process. Only the item at the head is blamed: it gets TIMEOUT (or,
after a second crash, ERROR); the items sent behind it go back to the queue, behind the other callers'
next items (issue 46: resent first, a hanging scorer's items held other callers' 1-item calls ~26 s).
Each item travels with a sequence number and its answer must carry the same one: an answer that does
not (a scorer that forked leaves two processes answering on the pipe) is discarded and the worker
replaced, never matched to the wrong item by pipe order.

The window is 1 until the worker's last `FAST_STREAK` items each took under `FAST_ITEM_S` (and after
every restart): an item sent behind a slow one would wait for it however other calls are queued
(issue 46: 40 items of ~2.6 s each, four in each pipe, held 1-item calls past their 5 s deadlines).

One more process than `num_workers`, the express worker, takes only the first item of a call that has not started
while every worker is busy (`WorkQueues.get_express`), so a new call's first answer does not wait for the items
running (CI: a 1-item call waited 5 s for one ~2.6 s CPU item beside another test's load). The OS shares the cores
among the processes: the express item costs the running ones only its own few ms of CPU. Its window stays 1.

Work the pool skips (RL checks a question's G responses together, and many share a final answer):
- `prepare_check` runs here, in the caller's thread: items with no answer, or an answer or gold answer
  over `max_answer_chars`, are decided without a worker.
- The verdict cache (`verdict_cache_size` entries, LRU) maps a `CheckKey` (extracted answer, stripped
  gold answer; the pool's options are fixed) to its verdict. Only CORRECT, WRONG, UNPARSEABLE and
  GOLD_UNPARSEABLE are stored: they are functions of the key. TIMEOUT and ERROR depend on the process
  (CPU, memory, a kill) and are never stored, so a later call checks that key afresh.
- An item whose key is already queued or running joins that check instead of queuing its own, and
  gets its result, whatever it is. That includes a TIMEOUT/ERROR, on purpose: the identical input was
  being checked at that moment, and checking it again would cost another `item_timeout_s` and worker
  restart per copy (16 copies of one pathological answer would stall a worker for 16 timeouts).
  Joining is part of the verdict cache: `verdict_cache_size=0` turns both off.
- Checks go to the worker that owns their gold answer (`WorkQueues`), so the worker's parse cache
  (`parse_cache_size` gold answers and as many extracted answers) parses it once.
A result that did not run a check (decided, cached, joined) has `seconds` 0: no worker time was spent on it.

A verify call is a `VerifyBatch`. Cancelling it (the caller gave up, or its deadline passed) makes
the dispatchers drop its checks that are not yet in a worker's pipe, unless another live call joined
them; at most `WINDOW` checks per worker that were already sent still run (each bounded by
`item_timeout_s`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass, field

from rlep.common.types import Verdict
from rlep.services.verifier.cache import LruCache
from rlep.services.verifier.judge import CheckKey, CheckOptions, CheckResult, prepare_check
from rlep.services.verifier.python_scorer import ScoreCall
from rlep.services.verifier.queues import CLOSED, WorkQueues
from rlep.services.verifier.worker import ParseStats, Worker, worker_context

log = logging.getLogger(__name__)

# Items in one worker's pipe at a time: the next ones wait there while one runs, so the worker does not
# idle while its dispatcher thread waits to be scheduled (on a loaded host a window of 2 measured slower
# than 4), and a cancelled request still costs at most this many items per worker.
WINDOW = 4
# The window above is used only while items are fast: after FAST_STREAK items in a row under FAST_ITEM_S each. A
# slower item, a timeout or a restart drops the window to 1, so a new call waits for at most one item per worker
# (plus, in a fast streak, WINDOW - 1 items that turned out slow). The window saves a dispatch round trip (~1 ms)
# per item, which matters for items of a few ms; the threshold sits well above math-verify's usual 3-10 ms so that
# a rare slower item does not close the window for the next FAST_STREAK.
FAST_ITEM_S = 0.25
FAST_STREAK = 16
# Verdicts that are functions of the CheckKey alone, hence safe to reuse (see the module docstring).
CACHEABLE = frozenset({Verdict.CORRECT, Verdict.WRONG, Verdict.UNPARSEABLE, Verdict.GOLD_UNPARSEABLE})


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


@dataclass(eq=False)
class _Job:
    """One check of a key, and every item (batch, position) waiting for its result; the first is the leader."""

    key: CheckKey | ScoreCall
    waiters: list[tuple[VerifyBatch, int]] = field(default_factory=list)
    crashed: bool = False  # its worker crashed once with it at the head: a second crash makes it ERROR


class VerifyPool:
    """Checks (response, ground_truth) pairs on `num_workers` processes.

    Args:
        num_workers: worker processes (one per core is the sweet spot: the work is CPU-bound).
        item_timeout_s: hard wall-clock limit for one item in a worker; past it the worker is replaced.
        options: limits passed to `check_key`.
        memory_limit_mb: address-space limit of each worker (0 = none).
        verdict_cache_size: verdicts kept by key (LRU); 0 turns the verdict cache and joining off.
        parse_cache_size: parsed gold answers, and as many parsed extracted answers, kept per worker (LRU).
        on_restart: called with "timeout" or "crash" each time a worker is replaced (metrics).
        on_skip: called once for each item dropped unchecked because its batch was cancelled (metrics).
        on_cache: called with (cache, hit, count) for lookups: cache is "verdict", "in_flight", "gold" or
            "answer" (metrics). A verdict-cache miss that joins a running check reports ("in_flight", True).
        express: run the express worker (see the module docstring); off only to test the queues behind it.
    """

    def __init__(
        self,
        num_workers: int,
        item_timeout_s: float,
        options: CheckOptions = CheckOptions(),
        memory_limit_mb: int = 0,
        verdict_cache_size: int = 0,
        parse_cache_size: int = 4096,
        on_restart: Callable[[str], None] | None = None,
        on_skip: Callable[[], None] | None = None,
        on_cache: Callable[[str, bool, int], None] | None = None,
        express: bool = True,
    ):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.item_timeout_s = item_timeout_s
        self._options = options
        self._on_restart = on_restart or (lambda reason: None)
        self._on_skip = on_skip or (lambda: None)
        self._on_cache = on_cache or (lambda cache, hit, count: None)
        self._queues: WorkQueues[_Job] = WorkQueues(num_workers)
        # Guards the verdict cache, the checks in flight by key, and every job's waiters.
        self._jobs_lock = threading.Lock()
        self._verdicts: LruCache[CheckKey, Verdict] = LruCache(verdict_cache_size)
        self._in_flight: dict[CheckKey, _Job] = {}
        self._share = verdict_cache_size > 0
        self._counts_lock = threading.Lock()
        # checked: checks answered by workers; skipped: items dropped as cancelled; resent: checks in a worker's
        # pipe when it was replaced, so sent again; decided: items needing no math-verify; cached: items
        # answered from the verdict cache; joined: items answered by an identical item's check; express: checks the
        # express worker answered (in "checked" too, not in the per-worker lists).
        self._counts = {k: 0 for k in ("checked", "skipped", "resent", "decided", "cached", "joined", "express")}
        self._checked_by_worker = [0] * num_workers
        self._gold_parsed_by_worker = [0] * num_workers
        self._express = num_workers  # the express worker's index in `_workers`, `_busy` and `_threads`, if any
        self._busy = [threading.Event() for _ in range(num_workers + express)]
        ctx = worker_context()
        self._workers = [Worker(ctx, options, memory_limit_mb, parse_cache_size, wait=False) for _ in self._busy]
        try:
            for worker in self._workers:  # started together: each imports sympy and math-verify (1-3 s)
                worker.wait_ready()
        except RuntimeError:
            for worker in self._workers:
                worker.kill()
            raise
        names = [f"verify-{i}" for i in range(num_workers)] + ["verify-express"]
        self._threads = [
            threading.Thread(target=self._dispatch, args=(i,), name=names[i], daemon=True)
            for i in range(len(self._workers))
        ]
        for thread in self._threads:
            thread.start()

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers[: self._express]]

    def worker_for(self, gold: str) -> int:
        """The worker index that checks items with this gold answer (unless another one is idle and steals)."""
        return self._queues.worker_for(gold.strip())

    def counts(self) -> dict[str, int | list[int]]:
        """Work done so far (see `__init__` for the keys), plus per worker slot: checks and gold answers parsed."""
        with self._counts_lock:
            return {
                **self._counts,
                "checked_by_worker": list(self._checked_by_worker),
                "gold_parsed_by_worker": list(self._gold_parsed_by_worker),
            }

    def verdict_cache_entries(self) -> int:
        with self._jobs_lock:
            return len(self._verdicts)

    def wait_busy(self, worker_index: int, timeout_s: float) -> bool:
        """Blocks until that worker (`num_workers`: the express one) has an item in its pipe or running; False if
        `timeout_s` passes first.

        The flag drops before the result of a worker's last item is set, so after a call returns this
        waits for the next call's items, not the finished call's.
        """
        return self._busy[worker_index].wait(timeout_s)

    def _count(self, key: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[key] += n

    def _claim(self, job: _Job) -> bool:
        """True when some caller still waits for the job; else forgets it and counts its items as skipped."""
        with self._jobs_lock:
            if any(not batch.cancelled for batch, _ in job.waiters):
                return True
            if self._in_flight.get(job.key) is job:
                del self._in_flight[job.key]
            dropped = len(job.waiters)
        self._count("skipped", dropped)
        for _ in range(dropped):
            self._on_skip()
        return False

    def _finish(self, job: _Job, result: CheckResult) -> None:
        """Hands a check's result to every waiting item; stores it when it is a function of the key."""
        with self._jobs_lock:
            if self._in_flight.get(job.key) is job:
                del self._in_flight[job.key]
            if self._share and isinstance(job.key, CheckKey) and result.verdict in CACHEABLE:
                self._verdicts.put(job.key, result.verdict)
            waiters = list(job.waiters)  # no one joins once the job left _in_flight
        (batch, index), *joined = waiters
        batch.set_result(index, result)
        if joined:
            shared = dataclasses.replace(result, seconds=0.0)
            for batch, index in joined:
                batch.set_result(index, shared)
            self._count("joined", len(joined))

    def _next_job(self, index: int, resend: collections.deque[_Job], block: bool, use_queue: bool):
        """The next job someone waits for, `CLOSED`, or None when none is ready. `resend` holds jobs taken back
        while stopping (the queues may have no other reader left by then)."""
        while True:
            if resend:
                job = resend.popleft()
            elif not use_queue:
                return None
            else:
                queues = self._queues
                job = queues.get_express(block) if index == self._express else queues.get(index, block)
                if job is None or job is CLOSED:
                    return job
            if self._claim(job):
                return job

    def _dispatch(self, index: int) -> None:
        worker, busy = self._workers[index], self._busy[index]
        express = index == self._express
        sent: collections.deque[tuple[int, _Job]] = collections.deque()  # (seq, job) in the worker's pipe, in order
        resend: collections.deque[_Job] = collections.deque()  # taken back while stopping
        seqs = itertools.count()
        head_since = 0.0  # when the head item of `sent` started running
        fast_needed = FAST_STREAK  # fast items still to see before the window opens to WINDOW
        stopping = False  # the queues are closed and empty: finish what this thread holds, take nothing new
        while True:
            while len(sent) < (WINDOW if fast_needed == 0 and not express else 1):
                job = self._next_job(index, resend, block=not sent, use_queue=not stopping)
                if job is CLOSED:
                    stopping = True
                    continue
                if job is None:
                    break
                if not sent and not worker.process.is_alive():  # died while idle: no item's fault
                    self._replace(worker, "crash")
                seq = next(seqs)
                try:
                    worker.conn.send((seq, job.key))
                except OSError:  # died with items in its pipe: the receive below blames the head
                    resend.appendleft(job)
                    break
                if not sent:
                    head_since = time.monotonic()
                    busy.set()
                sent.append((seq, job))
            if not sent:
                if resend:  # the worker died between the idle check and the send
                    self._replace(worker, "crash")
                    continue
                break  # stopping, and nothing left to do
            outcome = self._receive(worker, sent, head_since, index)
            if not isinstance(outcome, str):
                head_since = time.monotonic()  # the next item was already in the pipe
                fast_needed = max(0, fast_needed - 1) if outcome < FAST_ITEM_S else FAST_STREAK
                continue
            fast_needed = FAST_STREAK
            _, head = sent[0]
            busy.clear()  # before any result is set: a caller that saw its result sees the flag down
            self._replace(worker, outcome)
            self._count("resent", len(sent) - 1)
            # A timeout is the item's doing; a crash may be the host's, so the head gets one retry.
            if outcome == "timeout" or head.crashed:
                sent.popleft()
                verdict = Verdict.TIMEOUT if outcome == "timeout" else Verdict.ERROR
                why = (
                    f"over item_timeout_s ({self.item_timeout_s:g} s): worker killed"
                    if outcome == "timeout"
                    else ("the worker died on it twice")
                )
                self._finish(head, CheckResult(verdict, "", self.item_timeout_s, error=why))
            else:
                head.crashed = True
                self._count("resent")
            jobs = [job for _, job in sent]
            sent.clear()
            if stopping or express:  # the express worker's pipe holds one item: a crashed head it retries itself
                resend.extendleft(reversed(jobs))
            else:  # back in the queue: the blamed head's caller after every other caller's next item
                self._queues.put_back(index, [(job.waiters[0][0], job) for job in jobs], last=head.waiters[0][0])
        busy.clear()
        worker.kill()

    def _receive(
        self, worker: Worker, sent: collections.deque[tuple[int, _Job]], head_since: float, index: int
    ) -> float | str:
        """Waits for the head item's answer: the seconds it took, else "timeout" or "crash"."""
        try:
            if not worker.conn.poll(max(0.0, self.item_timeout_s - (time.monotonic() - head_since))):
                return "timeout"
            seq, result, stats = worker.conn.recv()
        except (EOFError, OSError):
            return "crash"
        except Exception as err:  # garbled by a second reader of the pipe (a forked scorer): not an answer
            log.warning("verifier worker %s: unreadable answer (%s)", worker.process.pid, err)
            return "crash"
        expected, job = sent[0]
        if seq != expected:
            log.warning("verifier worker %s answered item %s while %s was due", worker.process.pid, seq, expected)
            return "crash"
        sent.popleft()
        if not sent:
            self._busy[index].clear()  # before the result is set (see `wait_busy`)
        with self._counts_lock:
            self._counts["checked"] += 1
            if index == self._express:
                self._counts["express"] += 1
            else:
                self._checked_by_worker[index] += 1
                self._gold_parsed_by_worker[index] += stats.gold_misses
        self._report_parses(stats)
        self._finish(job, result)
        return result.seconds

    def _report_parses(self, stats: ParseStats) -> None:
        for cache, hits, misses in (
            ("gold", stats.gold_hits, stats.gold_misses),
            ("answer", stats.answer_hits, stats.answer_misses),
        ):
            if hits:
                self._on_cache(cache, True, hits)
            if misses:
                self._on_cache(cache, False, misses)

    def _replace(self, worker: Worker, reason: str) -> None:
        log.warning("verifier worker %s: %s; replacing it", worker.process.pid, reason)
        while True:  # a worker that fails to start (e.g. fork limits) is retried, never abandoned
            try:
                worker.restart()
                break
            except (RuntimeError, OSError) as err:
                log.error("could not restart a verifier worker (%s); retrying", err)
                time.sleep(1.0)
        self._on_restart(reason)

    def start(self, items: Sequence[tuple[str, str] | ScoreCall], use_cache: bool = True) -> VerifyBatch:
        """Answers what it can at once and queues the rest; wait on (or cancel) the returned batch. Items are
        (response, ground_truth) pairs for math-verify, or `ScoreCall`s (never cached or joined: a user's function
        need not be deterministic). `use_cache=False` sends every math item to a worker (health probes must)."""
        batch = VerifyBatch(len(items))
        self.submit(batch, list(enumerate(items)), use_cache)
        return batch

    def submit(
        self, batch: VerifyBatch, items: Sequence[tuple[int, tuple[str, str] | ScoreCall]], use_cache: bool = True
    ) -> None:
        """`start` for some positions of a batch that other scorers fill in too: (position, item) pairs."""
        share = self._share and use_cache
        prepared = [  # outside the lock
            (i, item if isinstance(item, ScoreCall) else prepare_check(*item, self._options)) for i, item in items
        ]
        ready: list[tuple[int, CheckResult]] = []
        new_jobs: list[_Job] = []
        hits = joins = misses = 0
        with self._jobs_lock:
            for i, key in prepared:
                if isinstance(key, CheckResult):
                    ready.append((i, key))
                    continue
                shared = share and isinstance(key, CheckKey)
                if shared:
                    if (verdict := self._verdicts.get(key)) is not None:
                        ready.append((i, CheckResult(verdict, key.answer, 0.0)))
                        hits += 1
                        continue
                    misses += 1
                    if (job := self._in_flight.get(key)) is not None:
                        job.waiters.append((batch, i))
                        joins += 1
                        continue
                job = _Job(key, [(batch, i)])
                if shared:
                    self._in_flight[key] = job
                new_jobs.append(job)
        self._count("decided", len(ready) - hits)
        self._count("cached", hits)
        if share:
            self._on_cache("verdict", True, hits)
            self._on_cache("verdict", False, misses)
            self._on_cache("in_flight", True, joins)
        self._queues.put([(_route_of(job.key), job) for job in new_jobs], caller=batch)
        for i, result in ready:
            batch.set_result(i, result)

    def verify(
        self, items: Sequence[tuple[str, str] | ScoreCall], timeout_s: float | None = None, use_cache: bool = True
    ) -> list[CheckResult]:
        """Checks every item; results in order. Raises TimeoutError if `timeout_s` runs out first."""
        batch = self.start(items, use_cache)
        try:
            return batch.wait(timeout_s)
        finally:
            batch.cancel()  # after a timeout: the unsent items are dropped, not checked for nobody

    def close(self) -> None:
        self._queues.close()
        for thread in self._threads:
            thread.join(timeout=10)


def _route_of(key: CheckKey | ScoreCall) -> str:
    """What picks an item's worker: its gold answer, whose parse that worker then caches."""
    return key.gold if isinstance(key, CheckKey) else key.ground_truth
