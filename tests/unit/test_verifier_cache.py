"""The verifier's caches and routing as pure logic: LRU bound, per-worker queues, cached parses = fresh ones."""

from __future__ import annotations

import threading
import time

import pytest

from rlep.common.types import Verdict
from rlep.services.verifier.cache import LruCache
from rlep.services.verifier.judge import CheckKey, CheckOptions, ParseCache, check_answer, check_key, prepare_check
from rlep.services.verifier.queues import CLOSED, WorkQueues


def test_lru_cache_holds_its_bound_and_drops_the_least_recently_used():
    cache: LruCache[int, str] = LruCache(3)
    for key in range(3):
        cache.put(key, str(key))
    assert cache.get(0) == "0"  # 0 is now the most recent: 1 goes first
    for key in range(3, 10):
        cache.put(key, str(key))
        assert len(cache) <= 3
    assert len(cache) == 3
    assert [cache.get(k) for k in (7, 8, 9)] == ["7", "8", "9"]
    assert cache.get(0) is None and cache.get(1) is None
    assert (cache.hits, cache.misses) == (4, 2)


def test_lru_cache_of_size_zero_stores_nothing():
    cache: LruCache[str, int] = LruCache(0)
    cache.put("a", 1)
    assert cache.get("a") is None and len(cache) == 0


def _golds_of_worker(queues: WorkQueues, worker: int, count: int) -> list[str]:
    return [g for g in (str(n) for n in range(1000)) if queues.worker_for(g) == worker][:count]


def test_items_with_one_gold_answer_go_to_one_worker_and_idle_workers_steal_from_the_tail():
    queues: WorkQueues[str] = WorkQueues(2)
    [gold_a], [gold_b] = _golds_of_worker(queues, 0, 1), _golds_of_worker(queues, 1, 1)
    queues.put([(gold_a, "a1"), (gold_b, "b1"), (gold_a, "a2"), (gold_b, "b2"), (gold_b, "b3")])
    assert queues.sizes() == [2, 3]
    assert [queues.get(0, block=False), queues.get(0, block=False)] == ["a1", "a2"]
    assert queues.get(1, block=False) == "b1"  # the owner keeps its head
    assert queues.get(0, block=False) == "b3"  # worker 0 has nothing left: it takes the tail of worker 1
    assert queues.get(1, block=False) == "b2"
    assert queues.get(0, block=False) is None
    queues.close()
    assert queues.get(1, block=True) is CLOSED


def test_a_worker_serves_its_callers_round_robin_so_a_small_call_never_waits_for_a_large_one():
    """Issue 31: one call of 40 slow items made 1-item calls behind it miss their 5 s deadlines."""
    queues: WorkQueues[str] = WorkQueues(1)
    big, small, other = object(), object(), object()
    queues.put([("g", f"big{i}") for i in range(40)], caller=big)
    queues.put([("g", "small0")], caller=small)
    queues.put([("g", "other0"), ("g", "other1")], caller=other)
    served = [queues.get(0, block=False) for _ in range(6)]
    assert served == ["big0", "small0", "other0", "big1", "other1", "big2"]  # one item per caller in turn
    assert queues.sizes() == [37]


def test_a_call_that_comes_mid_round_is_served_before_the_callers_already_served_and_starves_none():
    """Issue 46: a 1-item call that came while a big call's item ran waited for that item and then the big call's
    next one (two ~2.6 s items, past its 5 s deadline): it was queued behind the caller served just before."""
    queues: WorkQueues[str] = WorkQueues(1)
    big = object()
    queues.put([("g", f"big{i}") for i in range(4)], caller=big)
    served = [queues.get(0, block=False)]  # big0 runs
    for n in range(3):  # a new 1-item call during each of big's items
        queues.put([("g", f"new{n}")], caller=object())
        served += [queues.get(0, block=False), queues.get(0, block=False)]
    assert served == ["big0", "new0", "big1", "new1", "big2", "new2", "big3"]


def test_items_taken_back_from_a_replaced_worker_wait_their_callers_turn():
    """Issue 46: the items behind a timed-out one were resent before every other call's (a hanging scorer's items
    held 1-item calls ~26 s). Now the blamed item's caller waits for every other caller's next item."""
    queues: WorkQueues[str] = WorkQueues(1)
    hanging, small, other = object(), object(), object()
    queues.put([("g", "hang4"), ("g", "hang5")], caller=hanging)
    queues.put([("g", "other0")], caller=other)
    # The pipe held hang0 (timed out), small's item and hang1..hang3: they come back, hang0's caller last.
    queues.put_back(0, [(small, "small0"), (hanging, "hang1"), (hanging, "hang2"), (hanging, "hang3")], last=hanging)
    served = [queues.get(0, block=False) for _ in range(7)]
    assert served == ["small0", "other0", "hang1", "hang2", "hang3", "hang4", "hang5"]
    assert queues.get(0, block=False) is None


def test_a_steal_takes_the_tail_of_the_caller_with_the_most_queued():
    queues: WorkQueues[str] = WorkQueues(2)
    [gold_b] = _golds_of_worker(queues, 1, 1)
    queues.put([(gold_b, "small0")], caller="small")
    queues.put([(gold_b, f"big{i}") for i in range(5)], caller="big")
    assert queues.get(1, block=False) == "small0"  # the owner: round-robin from the first caller
    assert queues.get(0, block=False) == "big4"  # the thief: the largest caller's tail
    assert queues.sizes() == [0, 4]


def test_the_queue_of_an_idle_owner_is_left_to_it():
    """An owner waiting for work takes its gold answers itself (its parse cache may hold them): no stealing."""
    queues: WorkQueues[str] = WorkQueues(2)
    [gold_b] = _golds_of_worker(queues, 1, 1)
    taken: list = []
    owner = threading.Thread(target=lambda: taken.append(queues.get(1, block=True)), daemon=True)
    owner.start()
    try:
        deadline = time.monotonic() + 10
        while not queues._idle[1]:  # the owner is blocked in get, waiting
            assert time.monotonic() < deadline
            time.sleep(0.001)
        queues.put([(gold_b, "b1")])
        assert queues.get(0, block=False) is None  # not stolen, whether or not the owner has woken yet
    finally:
        queues.close()  # releases the owner if it still waits
        owner.join(timeout=10)
    assert taken == ["b1"]


def test_the_express_worker_takes_a_new_calls_first_item_only_while_every_worker_is_busy():
    """A 1-item call waited for the slow item running on its worker (CI: past its 5 s deadline)."""
    queues: WorkQueues[str] = WorkQueues(1)
    big, small, pair = object(), object(), object()
    queues.put([("g", f"big{i}") for i in range(3)], caller=big)
    assert queues.get_express(block=False) is None  # worker 0 has not asked yet: it takes big0 itself
    assert queues.get(0, block=False) == "big0"
    assert queues.get_express(block=False) is None  # big has started: its next items wait their turn
    queues.put([("g", "small0")], caller=small)
    queues.put([("g", "pair0"), ("g", "pair1")], caller=pair)
    assert [queues.get_express(block=False), queues.get_express(block=False)] == ["small0", "pair0"]
    assert queues.get_express(block=False) is None  # pair1 is not a first item
    assert [queues.get(0, block=False) for _ in range(3)] == ["pair1", "big1", "big2"]
    queues.close()
    assert queues.get_express(block=True) is CLOSED


def test_items_put_back_after_a_timeout_are_not_the_express_workers_but_others_behind_them_are():
    """The blamed caller's items may hang the express worker as they hung the worker; a 1-item call's item that was
    in the same pipe has nothing running and is a first item again."""
    queues: WorkQueues[str] = WorkQueues(1)
    hanging, small = object(), object()
    queues.put([("g", "hang0")], caller=hanging)
    assert queues.get(0, block=False) == "hang0"
    queues.put_back(0, [(small, "small0"), (hanging, "hang1")], last=hanging)
    assert queues.get_express(block=False) == "small0"
    assert queues.get_express(block=False) is None
    assert queues.get(0, block=False) == "hang1"


def test_closed_queues_still_hand_out_what_was_queued():
    queues: WorkQueues[str] = WorkQueues(3)
    queues.put([("7", "x")])
    queues.close()
    assert [queues.get(0, block=True), queues.get(0, block=True)] == ["x", CLOSED]


ITEMS = [  # (response, gold): right, wrong, unparseable answers, and gold answers math-verify cannot read
    ("so \\boxed{\\frac{2}{4}}", "0.5"),
    ("\\boxed{0.5}", "0.5"),
    ("\\boxed{3}", "0.5"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{2}"),
    ("\\boxed{}", "4"),
    ("\\boxed{3}", "???"),
    ("Answer: 12", "12"),
]


def test_checks_through_a_parse_cache_equal_fresh_checks_and_hit_it():
    options = CheckOptions()
    cache = ParseCache(16)
    fresh = [check_answer(r, g, options) for r, g in ITEMS]
    assert {f.verdict for f in fresh} >= {Verdict.CORRECT, Verdict.WRONG, Verdict.UNPARSEABLE, Verdict.GOLD_UNPARSEABLE}
    for _ in range(2):  # the second round answers every parse from the cache
        cached = [check_answer(r, g, options, cache) for r, g in ITEMS]
        assert [(c.verdict, c.extracted_answer) for c in cached] == [(f.verdict, f.extracted_answer) for f in fresh]
    assert cache.gold.hits >= len(ITEMS) and cache.answers.hits >= len(ITEMS) - 2


def test_a_key_holds_what_a_verdict_depends_on():
    options = CheckOptions(max_answer_chars=8)
    assert prepare_check("work \\boxed{ 1/2 }", "  0.5\n", options) == CheckKey("1/2", "0.5")
    assert prepare_check("\\boxed{123456789}", "1", options).verdict == Verdict.UNPARSEABLE
    assert prepare_check("\\boxed{1}", " ", options).verdict == Verdict.GOLD_UNPARSEABLE


@pytest.mark.parametrize("offset", [1_001, 2_003])
def test_a_gold_parse_cut_by_the_cpu_limit_is_timeout_and_not_cached(offset):
    """~0.07 s of CPU to parse: under a 5 ms limit it is TIMEOUT, and the cache keeps no empty parse of it."""
    gold = "+".join(f"\\frac{{{i}}}{{{i + offset}}}" for i in range(1, 60))  # new to math-verify's own LRU
    cache = ParseCache(8)
    tight = CheckOptions(max_answer_chars=10_000, parse_timeout_s=0.005)
    assert check_key(CheckKey("1", gold), tight, cache).verdict == Verdict.TIMEOUT
    assert len(cache.gold) == 0
    roomy = CheckOptions(max_answer_chars=10_000, parse_timeout_s=60)
    assert check_key(CheckKey(gold, gold), roomy, cache).verdict == Verdict.CORRECT
