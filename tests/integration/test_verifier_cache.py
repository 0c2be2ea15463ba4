"""The pool's verdict cache, in-flight sharing and gold-answer routing, on real worker processes and math-verify."""

from __future__ import annotations

import pytest

from rlep.common.types import Verdict
from rlep.services.verifier.judge import CheckOptions, check_answer
from rlep.services.verifier.pool import VerifyPool
from tests.metrics_util import scrape, series_value

pytestmark = pytest.mark.integration

ITEMS = [  # every verdict a check can reach, plus one decided without a worker
    ("so \\boxed{\\frac{2}{4}}", "0.5"),
    ("\\boxed{3}", "0.5"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}"),
    ("\\boxed{}", "4"),
    ("\\boxed{3}", "???"),
    ("no answer here", "4"),
]
# sympy evaluates this integer power in C; only the pool's hard timeout stops it.
HANGING_ITEM = ("\\boxed{9^{9^{9}}}", "3")


@pytest.fixture(scope="module")
def cached_pool():
    pool = VerifyPool(num_workers=2, item_timeout_s=30.0, verdict_cache_size=64)
    yield pool
    pool.close()


def test_a_cache_hit_returns_what_a_fresh_check_returns(cached_pool):
    fresh = [check_answer(r, g) for r, g in ITEMS]  # in this process, no cache at all
    first = cached_pool.verify(ITEMS, timeout_s=60)
    before = cached_pool.counts()
    again = cached_pool.verify(ITEMS, timeout_s=60)
    after = cached_pool.counts()
    expected = [(f.verdict, f.extracted_answer) for f in fresh]
    assert [(r.verdict, r.extracted_answer) for r in first] == expected
    assert [(r.verdict, r.extracted_answer) for r in again] == expected
    # The second call did no work: the cache answered every item a worker had checked.
    assert after["cached"] - before["cached"] == len(ITEMS) - 1 and after["checked"] == before["checked"]
    assert {r.seconds for r in again} == {0.0}


def test_identical_items_in_flight_share_one_check(cached_pool):
    group = [(f"sample {k}: so \\boxed{{\\frac{{5}}{{17}}}}", "5/17") for k in range(16)]  # responses differ
    before = cached_pool.counts()
    results = cached_pool.verify(group, timeout_s=60)
    after = cached_pool.counts()
    assert [r.verdict for r in results] == [Verdict.CORRECT] * 16
    assert after["checked"] - before["checked"] == 1 and after["joined"] - before["joined"] == 15


def test_the_verdict_cache_holds_its_bound():
    pool = VerifyPool(num_workers=1, item_timeout_s=30.0, verdict_cache_size=5)
    try:
        items = [(f"\\boxed{{{n}}}", str(n)) for n in range(20)]
        pool.verify(items, timeout_s=60)
        assert pool.verdict_cache_entries() == 5
        before = pool.counts()
        pool.verify(items[:1] + items[-1:], timeout_s=60)  # the oldest was dropped, the newest kept
        after = pool.counts()
        assert (after["checked"] - before["checked"], after["cached"] - before["cached"]) == (1, 1)
    finally:
        pool.close()


def test_items_of_one_gold_answer_are_checked_by_its_worker():
    """20 gold answers x 8 distinct responses: each gold answer is parsed once, by the worker that owns it.

    Checked on a shared FIFO instead, both workers take items of every group and parse ~40 gold answers.
    A worker that runs dry steals from the other's tail, which may add a parse or two at the end.
    """
    pool = VerifyPool(num_workers=2, item_timeout_s=30.0, verdict_cache_size=1024)
    try:
        golds = [f"\\frac{{{n}}}{{97}}" for n in range(1, 400)]
        golds = [g for g in golds if pool.worker_for(g) == 0][:10] + [g for g in golds if pool.worker_for(g) == 1][:10]
        items = [(f"\\boxed{{{k}/97}}", gold) for gold in golds for k in range(8)]
        before = pool.counts()
        results = pool.verify(items, timeout_s=120)
        after = pool.counts()
        assert Verdict.CORRECT in {r.verdict for r in results} and Verdict.WRONG in {r.verdict for r in results}
        parsed = [a - b for a, b in zip(after["gold_parsed_by_worker"], before["gold_parsed_by_worker"], strict=True)]
        checked = [a - b for a, b in zip(after["checked_by_worker"], before["checked_by_worker"], strict=True)]
        assert sum(parsed) <= len(golds) + 6, parsed
        assert min(checked) > 0, checked
    finally:
        pool.close()


def test_a_timed_out_item_is_shared_in_flight_but_never_cached():
    restarts: list[str] = []
    pool = VerifyPool(
        num_workers=1,
        item_timeout_s=1.0,
        options=CheckOptions(parse_timeout_s=60),
        verdict_cache_size=64,
        on_restart=restarts.append,
    )
    try:
        first = pool.verify([HANGING_ITEM] * 3 + [("\\boxed{4}", "4")], timeout_s=60)
        assert [r.verdict for r in first] == [Verdict.TIMEOUT] * 3 + [Verdict.CORRECT]
        assert restarts == ["timeout"] and pool.counts()["joined"] == 2  # one kill for three identical items
        [again] = pool.verify([HANGING_ITEM], timeout_s=60)
        assert again.verdict == Verdict.TIMEOUT
        assert restarts == ["timeout", "timeout"] and pool.counts()["cached"] == 0  # checked afresh, not cached
        assert [r.verdict for r in pool.verify([("\\boxed{4}", "4")], timeout_s=60)] == [Verdict.CORRECT]
    finally:
        pool.close()


def test_service_counts_cache_hits(verifier, verifier_client, auth_token_file):
    token = auth_token_file.read_text().strip()
    hits = 'rlep_verifier_cache_hits_total{cache="verdict"}'
    joined = 'rlep_verifier_cache_hits_total{cache="in_flight"}'
    gold_hits = 'rlep_verifier_cache_hits_total{cache="gold"}'
    before = {s: series_value(scrape(verifier.metrics_port, token), s) for s in (hits, joined, gold_hits)}
    item = ("\\boxed{\\frac{7}{113}}", "7/113")
    verifier_client.verify([item, item])  # the second joins the first's check
    verifier_client.verify([item])  # answered from the verdict cache
    verifier_client.verify([("\\boxed{8/113}", "7/113")])  # a new answer: its gold answer's worker has it parsed
    after = {s: series_value(scrape(verifier.metrics_port, token), s) for s in (hits, joined, gold_hits)}
    assert after[hits] - before[hits] == 1 and after[joined] - before[joined] == 1
    assert after[gold_hits] - before[gold_hits] == 1


def test_a_probe_past_the_cache_reaches_a_worker(cached_pool):
    """Health checks use `use_cache=False`: answered from the cache, they would prove nothing about workers."""
    item = ("\\boxed{1}", "1")
    cached_pool.verify([item], timeout_s=60)
    before = cached_pool.counts()
    [result] = cached_pool.verify([item], timeout_s=60, use_cache=False)
    after = cached_pool.counts()
    assert result.verdict == Verdict.CORRECT
    assert (after["checked"] - before["checked"], after["cached"] - before["cached"]) == (1, 0)
