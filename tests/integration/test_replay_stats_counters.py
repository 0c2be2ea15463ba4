"""GetPoolStats reads counters kept by every add, not every question (issue 46, item 8: 10^6 questions took
30+ s, and `rlep pool export` asks for the stats first). A redis-server of the test's own, so its command
counts are the store's alone."""

from __future__ import annotations

import logging
import random

import pytest
import redis

from rlep.common.redis_server import start_local_redis
from rlep.services.replay.sampling import Eviction
from rlep.services.replay.store import RedisReplayStore, StoredTrajectory, pool_prefix

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    local = start_local_redis(tmp_path_factory.mktemp("stats-redis"), appendfsync="no")
    yield redis.Redis.from_url(local.url)
    local.stop()


def successes(qid: str, count: int, first: int = 0, priority: float = 1.0) -> list[StoredTrajectory]:
    return [
        StoredTrajectory(qid, f"{qid}-t{k}", f"payload {qid} {k}".encode(), priority, 0, 3)
        for k in range(first, first + count)
    ]


def commands_run(client: redis.Redis) -> dict[str, int]:
    return {name: stat["calls"] for name, stat in client.info("commandstats").items()}


@pytest.mark.parametrize("eviction", list(Eviction))
def test_stats_read_a_fixed_number_of_keys_and_match_a_full_scan(own_redis, eviction):
    store = RedisReplayStore(own_redis, capacity_per_question=3, eviction=eviction)
    pool = f"counted-{eviction.value}"
    rng = random.Random(0)
    for start in range(0, 3000, 500):  # questions with 1..6 offered successes: 4..6 evict down to 3
        items = [t for q in range(start, start + 500) for t in successes(f"q{q}", rng.randint(1, 6))]
        store.add(pool, items, [])
    store.add(pool, successes("q7", 2) + successes("q8", 1, first=10, priority=5.0), [])  # duplicates, one more

    before = commands_run(own_redis)
    counters = store.stats(pool)
    ran = {name: calls - before.get(name, 0) for name, calls in commands_run(own_redis).items()}
    ran = {name: calls for name, calls in ran.items() if calls}
    # Before: one SMEMBERS and a ZCARD per question (3,000 here, 10^6 in the issue).
    assert "cmdstat_zcard" not in ran and "cmdstat_smembers" not in ran, ran
    assert sum(ran.values()) <= 10, ran

    assert counters.successes_per_question == store._scan_successes(pool)
    assert sum(counters.successes_per_question.values()) == 3000
    assert sum(k * v for k, v in counters.successes_per_question.items()) == counters.trajectories
    assert max(counters.successes_per_question) == 3


def test_a_pool_without_counters_is_scanned_with_a_warning(own_redis, caplog):
    store = RedisReplayStore(own_redis, capacity_per_question=4, eviction=Eviction.OLDEST)
    store.add("legacy", successes("a", 2) + successes("b", 1), [])
    own_redis.hdel(f"{pool_prefix('legacy')}:meta", "counted")  # as a pool written before the counters
    own_redis.delete(f"{pool_prefix('legacy')}:counts")
    with caplog.at_level(logging.WARNING, logger="rlep.services.replay.store"):
        assert store.stats("legacy").successes_per_question == {1: 1, 2: 1}
    assert "predates the per-question counters" in caplog.text
    store.add("legacy", successes("c", 1), [])  # adds to such a pool keep no counters: still scanned, still right
    assert store.stats("legacy").successes_per_question == {1: 2, 2: 1}
