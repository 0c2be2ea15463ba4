"""A pool's statistics, with no Redis: what GetPoolStats reports, computed from the counters the store keeps.

The store keeps running sums per pool (trajectories, response tokens and their squares, payload bytes) and
counts per length bucket and policy version, updated by each add and eviction; `pool_stats` turns them into
the mean and standard deviation of response lengths and the three histograms, each in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass

# (label, count) rows of a histogram, in the order they are reported.
Histogram = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class PoolCounters:
    """What the store holds about one pool, read in one pass (`RedisReplayStore.stats`)."""

    trajectories: int
    tokens_sum: int  # response tokens (words for a trajectory without token ids), summed over trajectories
    tokens_sq_sum: int  # their squares, summed
    payload_bytes: int
    capacity: int  # successes kept per question
    eviction: str
    successes_per_question: dict[int, int]  # successes -> questions holding that many (non-zero only)
    length_buckets: dict[str, int]  # `sampling.length_bucket` label -> trajectories (non-zero only)
    policy_versions: dict[int, int]  # policy version -> trajectories (non-zero only)
    redis_used_memory_bytes: int


@dataclass(frozen=True)
class PoolStats:
    """One pool's figures, as GetPoolStats reports them."""

    questions: int
    trajectories: int
    mean_response_tokens: float
    std_response_tokens: float  # population standard deviation
    payload_bytes: int
    redis_used_memory_bytes: int
    capacity_per_question: int
    eviction: str
    successes_per_question: Histogram  # successes -> questions holding that many, by successes ascending
    response_token_histogram: Histogram  # length bucket -> trajectories, by the bucket's lower bound
    per_policy_version: Histogram  # policy version -> trajectories, by version ascending


def pool_stats(counters: PoolCounters) -> PoolStats:
    """The figures of one pool; an empty pool has mean and standard deviation 0."""
    total = counters.trajectories
    mean = counters.tokens_sum / total if total else 0.0
    # Rounding can take sum(x^2)/n - mean^2 below zero for nearly equal lengths: clamp before the root.
    variance = max(counters.tokens_sq_sum / total - mean * mean, 0.0) if total else 0.0
    per_question = counters.successes_per_question
    return PoolStats(
        questions=sum(per_question.values()),
        trajectories=total,
        mean_response_tokens=mean,
        std_response_tokens=variance**0.5,
        payload_bytes=counters.payload_bytes,
        redis_used_memory_bytes=counters.redis_used_memory_bytes,
        capacity_per_question=counters.capacity,
        eviction=counters.eviction,
        successes_per_question=tuple((str(count), per_question[count]) for count in sorted(per_question)),
        response_token_histogram=tuple(
            (label, counters.length_buckets[label])
            for label in sorted(counters.length_buckets, key=lambda bucket: int(bucket.split("-")[0]))
        ),
        per_policy_version=tuple(
            (str(version), counters.policy_versions[version]) for version in sorted(counters.policy_versions)
        ),
    )
