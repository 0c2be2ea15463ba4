"""The worker pool's hard timeout and crash handling, on real worker processes and real math-verify."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import CancelledError
from pathlib import Path

import psutil
import pytest

from rlep.common.types import Verdict
from rlep.services.verifier.judge import CheckOptions
from rlep.services.verifier.pool import WINDOW, VerifyPool

pytestmark = pytest.mark.integration

# sympy evaluates this integer power in C; with math-verify's own timeout set far away, only the
# pool's hard timeout can stop it.
HANGING_ITEM = ("\\boxed{9^{9^{9}}}", "3")


def test_hung_worker_is_killed_and_replaced_without_failing_other_items():
    restarts: list[str] = []
    pool = VerifyPool(
        num_workers=1, item_timeout_s=1.0, options=CheckOptions(parse_timeout_s=60), on_restart=restarts.append
    )
    try:
        pid_before = pool.worker_pids[0]
        started = time.monotonic()
        results = pool.verify([("\\boxed{4}", "4"), HANGING_ITEM, ("\\boxed{5}", "5")])
        assert [r.verdict for r in results] == [Verdict.CORRECT, Verdict.TIMEOUT, Verdict.CORRECT]
        assert time.monotonic() - started < 30
        assert restarts == ["timeout"]
        assert pool.worker_pids[0] != pid_before
        # Started, and restarted, by forking multiprocessing's fork server, which imported math-verify once; not
        # spawned (each worker importing it again, ~0.5 CPU-s), not forked from this process (it runs threads).
        server = psutil.Process(psutil.Process(pool.worker_pids[0]).ppid())
        assert server.pid != os.getpid() and server.ppid() == os.getpid()
        assert "multiprocessing.forkserver" in " ".join(server.cmdline()) and "'math_verify'" in server.cmdline()[-1]
    finally:
        pool.close()


def test_verify_with_deadline_raises_timeout_error():
    pool = VerifyPool(num_workers=1, item_timeout_s=2.0, options=CheckOptions(parse_timeout_s=60))
    try:
        with pytest.raises(TimeoutError, match="unfinished"):
            pool.verify([HANGING_ITEM, ("\\boxed{1}", "1")], timeout_s=0.5)
    finally:
        pool.close()


# ~0.6-1.0 s of CPU in math-verify's comparison: slow but legal under a 2 s CPU limit per step.
SLOW_ITEM = ("\\boxed{\\sum_{n=1}^{\\infty} \\frac{1}{n^2}}", "\\frac{\\pi^2}{6}")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _item_cpu_seconds(item: tuple[str, str]) -> float:
    """The CPU time one worker spends on `item` (a fresh pool: nothing cached), under a generous limit."""
    pool = VerifyPool(num_workers=1, item_timeout_s=60.0, options=CheckOptions(parse_timeout_s=30))
    try:
        pid = pool.worker_pids[0]
        before = _cpu_seconds(pid)
        [result] = pool.start([item]).wait(timeout_s=60)
        assert result.verdict == Verdict.CORRECT
        return _cpu_seconds(pid) - before
    finally:
        pool.close()


def test_a_stalled_worker_keeps_its_verdict():
    """Load takes the CPU away from a worker mid-check: the limit counts CPU time, so the verdict stays."""
    # The item's cost differs between CPUs (1.6-1.9 s on one 2-core box): the limit is set well above it here.
    limit = max(2.0, 2.5 * _item_cpu_seconds(SLOW_ITEM))
    pool = VerifyPool(num_workers=1, item_timeout_s=30.0 + limit, options=CheckOptions(parse_timeout_s=limit))
    try:
        pid = pool.worker_pids[0]
        idle_cpu_s = _cpu_seconds(pid)
        batch = pool.start([SLOW_ITEM])
        assert pool.wait_busy(0, timeout_s=10)
        # Stop the worker once it is inside the check (it has used CPU on it), for longer than the limit.
        deadline = time.monotonic() + 30
        while _cpu_seconds(pid) < idle_cpu_s + 0.15:
            assert time.monotonic() < deadline, "the worker never started the item"
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(
                limit + 0.5
            )  # the stall itself (as a fully loaded machine would impose), not a wait for an event
        finally:
            os.kill(pid, signal.SIGCONT)
        [result] = batch.wait(timeout_s=30 + limit)
        assert result.seconds > limit + 0.5  # the stall fell inside the check, past the limit in wall time
        assert result.verdict == Verdict.CORRECT
    finally:
        pool.close()


def test_an_item_over_its_cpu_limit_is_timeout_without_killing_the_worker():
    restarts: list[str] = []
    pool = VerifyPool(
        num_workers=1, item_timeout_s=30.0, options=CheckOptions(parse_timeout_s=0.2), on_restart=restarts.append
    )
    try:
        pid = pool.worker_pids[0]
        results = pool.verify([SLOW_ITEM, ("\\boxed{3}", "3")], timeout_s=60)
        assert [r.verdict for r in results] == [Verdict.TIMEOUT, Verdict.CORRECT]
        assert restarts == [] and pool.worker_pids == [pid]  # the worker's own CPU limit ended it, not a kill
    finally:
        pool.close()


def test_cancelled_batch_drops_the_items_not_yet_sent():
    items = [(f"\\boxed{{\\frac{{{i}}}{{7}}+\\sqrt{{{i + 1}}}}}", f"{i}/7") for i in range(300)]
    pool = VerifyPool(num_workers=1, item_timeout_s=10.0)
    try:
        batch = pool.start(items)
        assert pool.wait_busy(0, timeout_s=10)
        batch.cancel()
        at_cancel = pool.counts()
        with pytest.raises(CancelledError):
            batch.wait(timeout_s=1)
        assert [r.verdict for r in pool.verify([("\\boxed{1}", "1")], timeout_s=30)] == [Verdict.CORRECT]
        # The worker drops the cancelled items as it reaches them (the express worker answered the call above).
        deadline = time.monotonic() + 30
        while (after := pool.counts())["skipped"] + after["checked"] - 1 < len(items):
            assert time.monotonic() < deadline, after
            time.sleep(0.01)
        # Only the items already in the worker's pipe (at most WINDOW) were checked after the cancel.
        assert after["checked"] - at_cancel["checked"] - 1 <= WINDOW
        assert after["skipped"] + after["checked"] - 1 == len(items)
    finally:
        pool.close()
