"""One verifier worker process: the loop it runs and the parent's handle that starts, kills and restarts it.

The parent sends `(seq, item)`, the item a `CheckKey` (math-verify) or a `ScoreCall` (a Python scorer); the worker
answers each with `(seq, CheckResult, ParseStats)`, the stats saying which of its parse caches the check hit. The
sequence number lets the parent reject an answer that is not the one it waits for (a scorer that forked leaves two
processes reading and answering on this pipe) instead of handing it to the wrong item. Only our own
processes on this host exchange pickled data over these pipes; nothing from the network is unpickled.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import resource
import signal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

from rlep.common.types import Verdict
from rlep.services.verifier.judge import CheckKey, CheckOptions, CheckResult, ParseCache, check_answer, check_key
from rlep.services.verifier.python_scorer import ScoreCall, ScoreFunction, run_score_call

# A fresh worker imports math-verify, sympy and antlr (1-3 s); allow for a loaded machine.
WORKER_START_TIMEOUT_S = 60.0
_READY = "ready"
# Checked before a worker reports ready, so the lazy imports of a first check (~0.06 s of CPU) are not
# billed to a real item's CPU limit.
WARMUP_ITEMS = (("\\boxed{\\frac{1}{2}+\\sqrt{2}}", "0.5+\\sqrt{2}"), ("\\boxed{\\sum_{k=1}^{3} k}", "6"))


class ParseStats(NamedTuple):
    """Lookups of one check in the worker's parse caches (each 0 or 1)."""

    gold_hits: int = 0
    gold_misses: int = 0
    answer_hits: int = 0
    answer_misses: int = 0


def _snapshot(cache: ParseCache) -> ParseStats:
    return ParseStats(cache.gold.hits, cache.gold.misses, cache.answers.hits, cache.answers.misses)


def _worker_main(conn: Connection, options: CheckOptions, memory_limit_mb: int, parse_cache_size: int) -> None:
    """Runs in the worker process: answer `CheckKey`s and `ScoreCall`s until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    if memory_limit_mb > 0:  # a runaway sympy expansion gets MemoryError, not the host's OOM killer
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for name in ("math_verify.parser", "math_verify.grader"):  # "you must provide the timeout yourself": we do
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))
    cache = ParseCache(parse_cache_size)
    functions: dict[str, ScoreFunction] = {}
    for response, ground_truth in WARMUP_ITEMS:
        check_answer(response, ground_truth, options, cache)
    conn.send(_READY)
    while True:
        try:
            message: tuple[int, CheckKey | ScoreCall] = conn.recv()
        except (EOFError, OSError):
            return
        seq, key = message
        before = _snapshot(cache)
        try:
            if isinstance(key, ScoreCall):
                result = run_score_call(key, options, functions)
            else:
                result = check_key(key, options, cache)
        except BaseException:  # anything else: the item failed, the worker lives on
            result = CheckResult(Verdict.ERROR, "")
        conn.send((seq, result, ParseStats(*(a - b for a, b in zip(_snapshot(cache), before, strict=True)))))


def worker_context() -> mp.context.BaseContext:
    """How worker processes start: forked from multiprocessing's fork server, which has imported the worker's
    modules once. Not a plain fork: the parent runs gRPC threads, and forking a threaded process is unsafe; the fork
    server is a process of its own, started clean, with one thread. Not spawn: every worker, and every restart
    after a timeout or crash, would import math-verify, sympy and antlr again (~1 s of CPU, 1-3 s on a busy
    machine). A worker gets its parent's sys.path and working folder at its start, as under spawn (the
    environment is the fork server's, taken when the parent first started a worker)."""
    mp.set_forkserver_preload([__name__, "math_verify", "math_verify.parser", "math_verify.grader"])
    return mp.get_context("forkserver")


def _children_of(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux's /proc; none where it lacks the children lists)."""
    children: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):  # the thread or the process is gone
            children.extend(int(child) for child in listing.read_text().split())
    return children


class Worker:
    """One worker process and its pipe; restarted in place after a timeout or crash."""

    def __init__(
        self,
        ctx: mp.context.BaseContext,
        options: CheckOptions,
        memory_limit_mb: int,
        parse_cache_size: int,
        wait: bool = True,
    ):
        """Starts the process; `wait=False` returns at once, and `wait_ready` must be called before any item."""
        self._ctx, self._args = ctx, (options, memory_limit_mb, parse_cache_size)
        self._spawn()
        if wait:
            self.wait_ready()

    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        self.process = self._ctx.Process(target=_worker_main, args=(child, *self._args), daemon=True)
        self.process.start()
        child.close()
        self.conn = parent

    def wait_ready(self) -> None:
        if not self.conn.poll(WORKER_START_TIMEOUT_S) or self.conn.recv() != _READY:
            raise RuntimeError("verifier worker did not start")

    def restart(self) -> None:
        self.kill()
        self._spawn()
        self.wait_ready()

    def kill(self) -> None:
        """Kills the worker and whatever a scorer forked from it: a forked child holds the worker's end of the
        pipe and its exit sentinel (`join` waited 5 s for it) and would go on answering items."""
        self.conn.close()  # a child it missed sees EOF at its next read
        if self.process.is_alive():  # not reaped: its pid, and its children's parent pid, are still its own
            for pid in _children_of(self.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.kill()
        self.process.join(timeout=5)
