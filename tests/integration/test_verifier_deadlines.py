"""A Verify call's work is bounded and stops with the call: no deadline, a passed deadline, a cancelled call.

Runs its own real verifiers (one math-verify worker each; a 1.5-s server limit, a 60-s one for calls their callers
abandon, a 120-s one for fairness) so the pool's counts of items checked and dropped belong to these tests alone.
"""

from __future__ import annotations

import itertools
import time

import grpc
import pytest

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.types import Verdict
from rlep.common.wire import VERDICT_TO_PROTO
from rlep.services.verifier.pool import WINDOW
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from tests.metrics_util import scrape, series_value

pytestmark = pytest.mark.integration

LIMIT_S = 1.5
BIG_ITEMS = 4000
_big_calls = itertools.count()
_small_calls = itertools.count()


def big_request(items: int = BIG_ITEMS) -> verifier_pb2.VerifyRequest:
    """Distinct items never sent before (sympy caches repeated ones, and the verdict cache would answer an earlier
    call's): ~3-10 ms each on one worker, so 10 s or more in all."""
    first = BIG_ITEMS * next(_big_calls)
    return verifier_pb2.VerifyRequest(
        items=[
            verifier_pb2.VerifyItem(response=f"\\boxed{{\\frac{{{i}}}{{7}}+\\sqrt{{{i + 1}}}}}", ground_truth=f"{i}/7")
            for i in range(first, first + items)
        ]
    )


def small_request() -> verifier_pb2.VerifyRequest:
    """Three items never sent before: the verdict cache cannot answer them, so they queue behind what is left."""
    n = 3 * next(_small_calls)
    return verifier_pb2.VerifyRequest(
        items=[verifier_pb2.VerifyItem(response=f"\\boxed{{{n + k}}}", ground_truth=str(n + k)) for k in range(3)]
    )


SMALL_ITEMS = 3
DROPPED = "rlep_verifier_items_dropped_total"


@pytest.fixture(scope="module")
def limited_verifier():
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.main import start_verifier

    running = start_verifier(
        VerifierConfig(server=ServerConfig(port=0, metrics_port=0), num_workers=1, request_timeout_s=LIMIT_S)
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(limited_verifier):
    channel = make_channel(f"127.0.0.1:{limited_verifier.port}")
    yield verifier_pb2_grpc.VerifierStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def patient_verifier():
    """(server, stub) with a 60-s limit: a call abandoned by its caller ends for the caller's reason, whatever the time
    the server takes to start its work (a 1-s deadline under the 1.5-s limit once ran out on a loaded 2-core host
    before any item reached the worker)."""
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.main import start_verifier

    running = start_verifier(
        VerifierConfig(server=ServerConfig(port=0, metrics_port=0), num_workers=1, request_timeout_s=60)
    )
    channel = make_channel(f"127.0.0.1:{running.port}")
    yield running, verifier_pb2_grpc.VerifierStub(channel)
    channel.close()
    running.stop()


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _assert_work_stopped(pool, stub, before: dict, at_stop: dict, big_items: int) -> None:
    """After the big call ended, a small call costs its own 3 items plus at most the WINDOW already sent."""
    reply = stub.Verify(small_request(), timeout=30)
    assert [r.verdict for r in reply.results] == [VERDICT_TO_PROTO[Verdict.CORRECT]] * 3

    def big_items_left() -> int:
        """Items of the big call not yet checked, answered from the cache or dropped: the small call is served
        between them, so it may return before the dispatcher has dropped every one (each when it reaches it)."""
        now = pool.counts()
        checked, cached = now["checked"] - before["checked"] - SMALL_ITEMS, now["cached"] - before["cached"]
        return big_items - checked - cached - (now["skipped"] - before["skipped"])

    assert _wait_for(lambda: big_items_left() == 0, timeout_s=10), (before, at_stop, pool.counts())
    after = pool.counts()
    checked_big = after["checked"] - before["checked"] - SMALL_ITEMS
    cached_big = after["cached"] - before["cached"]  # checked by an earlier test's call: answered at once
    assert after["checked"] - at_stop["checked"] - SMALL_ITEMS <= WINDOW, (before, at_stop, after)
    assert checked_big + cached_big < big_items / 2  # most were dropped unchecked


def test_call_without_deadline_gets_the_server_limit_and_its_work_stops(limited_verifier, stub):
    pool = limited_verifier.pool
    reply = stub.Verify(small_request())  # no deadline at all
    assert [r.verdict for r in reply.results] == [VERDICT_TO_PROTO[Verdict.CORRECT]] * 3
    dropped_before = series_value(scrape(limited_verifier.metrics_port), DROPPED)
    before = pool.counts()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stub.Verify(big_request())  # no deadline, several seconds of work
    elapsed = time.monotonic() - started
    at_stop = pool.counts()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"limit of {LIMIT_S:g} s per call (request_timeout_s)" in err.value.details()
    assert LIMIT_S <= elapsed < LIMIT_S + 3.0
    _assert_work_stopped(pool, stub, before, at_stop, BIG_ITEMS)
    dropped = series_value(scrape(limited_verifier.metrics_port), DROPPED) - dropped_before
    assert dropped == pool.counts()["skipped"] - before["skipped"] > 0


def _requests(verifier, code: str) -> float:
    return series_value(scrape(verifier.metrics_port), f'rlep_verifier_requests_total{{code="{code}"}}')


@pytest.mark.parametrize("ending", ["client cancels", "client deadline passes"])
def test_work_of_an_abandoned_call_stops(patient_verifier, ending):
    verifier, stub = patient_verifier
    pool = verifier.pool
    before = pool.counts()
    ended = {code: _requests(verifier, code) for code in ("CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")}
    # 3 s: time for a loaded host to start the work (1 s once was not), and at 3-10 ms an item well under half of the
    # big call's items, which is what `_assert_work_stopped` tells a stopped call by.
    future = stub.Verify.future(big_request(), timeout=60 if ending == "client cancels" else 3.0)
    assert pool.wait_busy(0, timeout_s=30)  # the big call's items are being checked
    if ending == "client cancels":
        future.cancel()
    else:
        with pytest.raises(grpc.RpcError) as err:
            future.result()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server learns of it asynchronously; the call ends for the caller's reason, not the server's limit.
    codes = ["CANCELLED"] if ending == "client cancels" else ["CANCELLED", "DEADLINE_EXCEEDED"]
    assert _wait_for(lambda: sum(_requests(verifier, c) - ended[c] for c in codes) == 1, timeout_s=10)
    assert _requests(verifier, "RESOURCE_EXHAUSTED") == ended["RESOURCE_EXHAUSTED"]
    _assert_work_stopped(pool, stub, before, pool.counts(), BIG_ITEMS)


@pytest.fixture(scope="module")
def fair_verifier():
    """One worker and a generous call limit: the big calls run for as long as the tests need them to."""
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.main import start_verifier

    running = start_verifier(VerifierConfig(server=ServerConfig(port=0), num_workers=1, request_timeout_s=120))
    channel = make_channel(f"127.0.0.1:{running.port}")
    yield running, verifier_pb2_grpc.VerifierStub(channel)
    channel.close()
    running.stop()


def test_small_calls_are_served_between_the_items_of_a_large_one(fair_verifier):
    """Before (issue 31): a big call held 1-item calls behind its whole batch, past their 5 s deadlines."""
    running, stub = fair_verifier
    big = stub.Verify.future(big_request())  # ~10 s or more of work on the one worker
    assert _wait_for(lambda: running.pool.counts()["checked"] >= 10, 30), "the big call never started"
    try:
        waits = []
        for _ in range(3):
            started = time.monotonic()
            reply = stub.Verify(small_request(), timeout=5)
            waits.append(time.monotonic() - started)
            assert [r.verdict for r in reply.results] == [VERDICT_TO_PROTO[Verdict.CORRECT]] * SMALL_ITEMS
        assert not big.done(), "the big call ended before the small ones were measured against it"
    finally:
        big.cancel()
    print(f"3-item calls beside a {BIG_ITEMS}-item call answered in {', '.join(f'{w:.2f}' for w in waits)} s")
    assert max(waits) < 2.0


def test_calls_beyond_the_servers_slots_are_refused_and_health_keeps_answering(fair_verifier):
    """Each Verify call waits on a gRPC thread: 16 slow ones took all 16, and the health check timed out."""
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    running, stub = fair_verifier
    answered = threading.Semaphore(0)
    calls = [stub.Verify.future(big_request(items=400)) for _ in range(16)]  # ~1-4 s each on one worker, at least
    for call in calls:
        call.add_done_callback(lambda _: answered.release())
    try:
        assert answered.acquire(timeout=30) and answered.acquire(timeout=30)  # 16 threads - 2 kept free = 14 slots
        refused = [c.exception() for c in calls if c.done()]
        assert len(refused) == 2, [str(e) for e in refused]
        assert all(e is not None and e.code() == grpc.StatusCode.UNAVAILABLE and "busy" in e.details() for e in refused)
        health = health_pb2_grpc.HealthStub(make_channel(f"127.0.0.1:{running.port}"))
        started = time.monotonic()
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() - started < 1.0
    finally:
        for call in calls:
            call.cancel()
