"""Calls share the verifier's workers when items are slow or a scorer misbehaves (issue 46, items 5 and 6).

Real verifier worker processes and real math-verify; the first test runs issue 31's case against a real gRPC server
on loopback, with the issue's numbers.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.types import Verdict
from rlep.common.wire import VERDICT_TO_PROTO
from rlep.services.verifier.judge import CheckOptions
from rlep.services.verifier.pool import FAST_STREAK, WINDOW, VerifyPool
from rlep.services.verifier.python_scorer import ScoreCall
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.integration


# The items ended TIMEOUT after ~2.6 s of CPU each; here the same item stops at the first step's CPU limit
# (1.0-1.3 s with the default 1 s), so the verifier below sets that limit to the 2.6 s.
SLOW_ITEM_CPU_S = 2.6


def slow_item(k: int) -> verifier_pb2.VerifyItem:
    """sympy works on this power until math-verify's CPU limit for a step stops it: TIMEOUT."""
    return verifier_pb2.VerifyItem(response=f"\\boxed{{10^{{10^{{10^{{10^{{{k + 2}}}}}}}}}}}", ground_truth="1")


def test_one_item_calls_beside_forty_slow_items_meet_their_deadlines():
    """Issue 31's case, still failing at issue 46: 2 workers, a call of 40 distinct slow items, then three 1-item calls
    with 5 s deadlines. Each worker's pipe held 4 of the slow items, so a 1-item call waited ~10 s behind them; with
    one item per pipe, round-robin still made it wait for the slow item running, past 5 s beside another test's load
    (CI; 4.28, 0.15 s and DEADLINE_EXCEEDED here beside two busy processes). The express worker answers it now."""
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.main import start_verifier

    config = VerifierConfig(
        server=ServerConfig(port=0),
        num_workers=2,
        request_timeout_s=120,
        parse_timeout_s=SLOW_ITEM_CPU_S,
        item_timeout_s=4 * SLOW_ITEM_CPU_S,
    )
    running = start_verifier(config)
    channel = make_channel(f"127.0.0.1:{running.port}")
    stub = verifier_pb2_grpc.VerifierStub(channel)
    big = stub.Verify.future(verifier_pb2.VerifyRequest(items=[slow_item(k) for k in range(40)]), timeout=120)
    try:
        assert running.pool.wait_busy(0, 30) and running.pool.wait_busy(1, 30), "the slow call never started"
        time.sleep(1.0)  # the case: the 1-item calls come 1 s into the slow call, not an event to wait for
        waits, codes = [], []
        for k in range(3):
            started = time.monotonic()
            try:
                request = verifier_pb2.VerifyRequest(
                    items=[verifier_pb2.VerifyItem(response=f"\\boxed{{{k + 7}}}", ground_truth=str(k + 7))]
                )
                [result] = stub.Verify(request, timeout=5).results
                codes.append("OK")
                assert result.verdict == VERDICT_TO_PROTO[Verdict.CORRECT]
            except grpc.RpcError as err:
                codes.append(err.code().name)
            waits.append(time.monotonic() - started)
        print(f"1-item calls beside 40 slow items: {codes}, {', '.join(f'{w:.2f}' for w in waits)} s")
        assert not big.done(), "the slow call ended before the small ones were measured against it"
        assert codes == ["OK"] * 3, waits
        # Not after the running slow item (>= 1.6 s of CPU left when the first came): by the express worker.
        assert max(waits) < 1.0 and running.pool.counts()["express"] == 3, waits
    finally:
        big.cancel()
        channel.close()
        running.stop()


# sympy evaluates these integer powers in C; with math-verify's own limit set far away, only the pool's wall-clock
# kill stops them (as it stops a hanging Python scorer).
def hanging_item(k: int) -> tuple[str, str]:
    return (f"\\boxed{{9^{{9^{{9}}}}+{k}}}", "3")


def test_a_hanging_item_holds_another_call_for_one_timeout_not_four():
    """Each worker's pipe held 4 hanging items; after the head's timeout the 3 behind it were resent first, so a
    1-item call of another caller waited for 4 timeouts and 4 worker restarts (~26 s with the defaults). Without the
    express worker (which would take the 1-item call at once): what the queues do when it is busy too."""
    pool = VerifyPool(num_workers=1, item_timeout_s=1.0, options=CheckOptions(parse_timeout_s=60), express=False)
    try:
        hanging = pool.start([hanging_item(k) for k in range(6)])
        assert pool.wait_busy(0, 30)
        [result] = pool.verify([("\\boxed{4}", "4")], timeout_s=60)
        assert result.verdict == Verdict.CORRECT
        finished = sum(r is not None for r in hanging.results)
        hanging.cancel()
        # Answered after the item the worker was on when it came (1), not after everything in the pipe (4).
        assert finished <= 1, f"{finished} hanging items were answered before the 1-item call"
    finally:
        pool.close()


def test_items_behind_a_hanging_one_go_back_behind_other_callers():
    """The worker's pipe holds 4 items once items are fast; when 3 hanging ones sit behind a 4th that times out, they
    go back to the queue behind another caller's item (they were sent again first: 4 timeouts before it). Without the
    express worker, as above."""
    pool = VerifyPool(num_workers=1, item_timeout_s=1.0, options=CheckOptions(parse_timeout_s=60), express=False)
    try:
        fast = [(f"\\boxed{{{k}}}", str(k)) for k in range(FAST_STREAK)]
        hanging = pool.start([*fast, *(hanging_item(k) for k in range(WINDOW))])
        deadline = time.monotonic() + 30
        while not (pool.counts()["checked"] >= FAST_STREAK and pool._queues.sizes() == [0]):  # all 4 in the pipe
            assert time.monotonic() < deadline, pool.counts()
            time.sleep(0.01)
        [result] = pool.verify([("\\boxed{4}", "4")], timeout_s=60)
        assert result.verdict == Verdict.CORRECT
        finished = sum(r is not None for r in hanging.results[FAST_STREAK:])
        hanging.cancel()
        assert finished == 1, f"{finished} hanging items were answered before the 1-item call"
    finally:
        pool.close()


def forks(response: str, ground_truth: str, extra: dict) -> float:
    """A scorer that forks and does not wait: the child returns into the worker's loop too, a second reader and
    writer of the worker's pipe."""
    os.fork()
    return 1.0


def test_a_scorer_that_forks_does_not_shift_later_verdicts():
    """Results were matched to items by pipe order: the forked child's extra answer went to the next item, and the
    verdicts after it shifted (3 of 40 math verdicts WRONG in the issue)."""
    restarts: list[str] = []
    pool = VerifyPool(num_workers=1, item_timeout_s=10.0, on_restart=restarts.append)
    try:
        forked = ScoreCall(f"{__name__}:forks", "r", "g", "", 0.5)
        items = [(f"\\boxed{{{k}}}", str(k if k % 2 else k + 1)) for k in range(40)]  # odd k CORRECT, even WRONG
        for _ in range(2):
            [result, *checked] = pool.verify([forked, *items], timeout_s=60)
            assert result.verdict == Verdict.CORRECT
            assert [r.verdict for r in checked] == [Verdict.CORRECT if k % 2 else Verdict.WRONG for k in range(40)]
            assert [r.extracted_answer for r in checked] == [str(k) for k in range(40)]
        # The child's extra answer was caught each time, and its worker (with the child) replaced.
        assert restarts == ["crash", "crash"]
    finally:
        pool.close()
