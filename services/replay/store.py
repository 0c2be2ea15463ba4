"""Redis storage of replay pools: the key schema, atomic idempotent adds, O(M) uniform sampling.

Key schema (the `{pool}` braces are a Redis Cluster hash tag: a pool's keys share one slot, so
its Lua scripts stay valid on a cluster):

    rlep:replay:pools                      SET   pool names
    rlep:replay:{P}:meta                   HASH  capacity, eviction, seq, trajectories, payload_bytes,
                                                 tokens_sum, tokens_sq_sum, counted (`counts` is kept)
    rlep:replay:{P}:counts                 HASH  successes -> questions holding that many (pools
                                                 created with `counted`; older ones are scanned)
    rlep:replay:{P}:questions              SET   question ids with at least one success
    rlep:replay:{P}:qmeta                  HASH  question id -> Question proto (prompt, gold, source)
    rlep:replay:{P}:versions               HASH  policy version -> trajectories
    rlep:replay:{P}:lengths                HASH  length bucket -> trajectories
    rlep:replay:{P}:q:<qid>:data           HASH  trajectory id -> Trajectory proto
    rlep:replay:{P}:q:<qid>:aux            HASH  trajectory id -> "version|tokens|bytes|bucket"
    rlep:replay:{P}:q:<qid>:ids            ZSET  trajectory id, score = insertion seq (oldest eviction)
    rlep:replay:{P}:q:<qid>:ver            ZSET  trajectory id, score = policy version (uniform by
                                                 index, staleness bound, recency)
    rlep:replay:{P}:q:<qid>:prio           ZSET  trajectory id, score = priority

Adds run in one Lua script per request, so a request is applied whole or not at all and a
duplicate is detected atomically. Uniform sampling runs as Lua calls of at most
`UNIFORM_PICKS_PER_CALL` picks each: per question it counts the successes, draws M distinct
indices with a seeded LCG and reads exactly those entries (ZRANGE by rank + HGET), O(M log n) per
question. Small calls keep Redis responsive to other clients, and between them (and between the
questions of the other strategies) a `SampleBudget` stops the work when the caller has gone or
the bytes read pass the limit.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import redis

from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2
from rlep.services.replay.lua import ADD_SCRIPT, SAMPLE_UNIFORM_SCRIPT
from rlep.services.replay.pool_stats import PoolCounters
from rlep.services.replay.requests import LimitExceeded
from rlep.services.replay.sampling import (
    Candidate,
    Eviction,
    Strategy,
    choose,
    length_bucket,
    question_rng,
    question_stream_seed,
)
from rlep.services.replay.types import PoolNotFound

log = logging.getLogger(__name__)

ROOT = "rlep:replay"
# One Lua call blocks every other client of Redis: ~2k picks take a few milliseconds.
UNIFORM_PICKS_PER_CALL = 2048


def _never_stop() -> None:
    return None


@dataclass
class SampleBudget:
    """What one Sample may cost: bytes read from Redis and diverse distance pairs.

    `keep_going` is called between units of work and raises when the caller has gone.
    """

    max_bytes: int
    max_diverse_pairs: int
    keep_going: Callable[[], None] = _never_stop
    bytes_read: int = 0

    def charge(self, payloads: Sequence[bytes]) -> None:
        self.bytes_read += sum(len(p) for p in payloads)
        if self.bytes_read > self.max_bytes:
            raise LimitExceeded(
                f"the sampled trajectories pass {self.max_bytes} bytes (max_sample_bytes); "
                "ask for fewer questions per call or a smaller m"
            )


def pool_prefix(pool: str) -> str:
    return f"{ROOT}:{{{pool}}}"


@dataclass(frozen=True)
class AddResult:
    added: int
    duplicate: int
    evicted: int


@dataclass(frozen=True)
class StoredTrajectory:
    """A validated trajectory ready for storage."""

    question_id: str
    trajectory_id: str
    payload: bytes  # serialized rlep.common.v1.Trajectory
    priority: float
    policy_version: int
    tokens: int


# One add's Lua call: ~500 rows took 25-130 ms where 20,000 rows held Redis for 1-5 s (issue 31).
ADD_CHUNK_ROWS = 500
ADD_CHUNK_BYTES = 8 * 1024 * 1024
PRIORITY_CHUNK = 1024  # priority updates per pair of pipelines (a read, then the writes)


def _chunks(
    questions: Sequence[replay_pb2.Question], items: Sequence[StoredTrajectory]
) -> Iterator[tuple[list[replay_pb2.Question], list[StoredTrajectory]]]:
    """Questions first, then trajectories, in pieces of at most ADD_CHUNK_ROWS rows and ADD_CHUNK_BYTES (a larger
    row alone). An add without rows is one empty piece: its call still creates the pool."""

    def split(piece: list) -> tuple[list, list]:
        return [r for r in piece if not isinstance(r, StoredTrajectory)], [
            r for r in piece if isinstance(r, StoredTrajectory)
        ]

    piece: list = []
    size = 0
    for row in [*questions, *items]:
        row_size = len(row.payload) if isinstance(row, StoredTrajectory) else row.ByteSize()
        if piece and (len(piece) == ADD_CHUNK_ROWS or size + row_size > ADD_CHUNK_BYTES):
            yield split(piece)
            piece, size = [], 0
        piece.append(row)
        size += row_size
    yield split(piece)


class RedisReplayStore:
    """Replay pools in one Redis. Thread-safe (redis-py's connection pool)."""

    def __init__(self, client: redis.Redis, capacity_per_question: int, eviction: Eviction):
        self.client = client
        self.capacity = capacity_per_question
        self.eviction = eviction
        self._add = client.register_script(ADD_SCRIPT)
        self._sample_uniform_script = client.register_script(SAMPLE_UNIFORM_SCRIPT)
        self._warned_scans: set[str] = set()

    def pools(self) -> list[str]:
        return sorted(m.decode() for m in self.client.smembers(f"{ROOT}:pools"))

    def require_pool(self, pool: str) -> None:
        if not self.client.sismember(f"{ROOT}:pools", pool):
            raise PoolNotFound(pool)

    def add(self, pool: str, items: Sequence[StoredTrajectory], questions: Sequence[replay_pb2.Question]) -> AddResult:
        """Stores `questions` and `items` in order, in Lua calls of at most ADD_CHUNK_ROWS rows and ADD_CHUNK_BYTES:
        Redis runs one script at a time, so one huge add would hold every other client for seconds. Each call is
        atomic and adds are idempotent (trajectory ids), so an add cut short by a failure is completed by a retry;
        eviction runs row by row either way, so chunking changes no outcome."""
        total = AddResult(0, 0, 0)
        for chunk_questions, chunk_items in _chunks(questions, items):
            args: list[bytes | str | int | float] = [
                pool_prefix(pool),
                f"{ROOT}:pools",
                pool,
                self.capacity,
                self.eviction.value,
                len(chunk_questions),
            ]
            for question in chunk_questions:
                args += [question.question_id, question.SerializeToString()]
            for item in chunk_items:
                args += [
                    item.question_id,
                    item.trajectory_id,
                    item.payload,
                    repr(float(item.priority)),
                    item.policy_version,
                    item.tokens,
                    length_bucket(item.tokens),
                ]
            added, duplicate, evicted = self._add(args=args)
            total = AddResult(total.added + int(added), total.duplicate + int(duplicate), total.evicted + int(evicted))
        return total

    def sample(
        self,
        pool: str,
        question_ids: Sequence[str],
        m: int,
        strategy: Strategy,
        seed: int,
        min_version: int = 0,
        budget: SampleBudget | None = None,
    ) -> list[tuple[list[bytes], int]]:
        """Per question: (payloads of up to m distinct successes, successes available).

        Raises LimitExceeded when the work would pass `budget`, and whatever `budget.keep_going` raises.
        """
        budget = budget or SampleBudget(max_bytes=1 << 62, max_diverse_pairs=1 << 62)
        if strategy == Strategy.UNIFORM:
            return self._sample_uniform(pool, question_ids, m, seed, min_version, budget)
        self.require_pool(pool)
        prefix = pool_prefix(pool)
        pipe = self.client.pipeline(transaction=False)
        for qid in question_ids:
            pipe.zcount(f"{prefix}:q:{qid}:ver", min_version, "+inf")
        counts = [int(c) for c in pipe.execute()]
        if strategy == Strategy.DIVERSE:
            pairs = sum(n * n for n in counts)
            if pairs > budget.max_diverse_pairs:
                raise LimitExceeded(
                    f"diverse sampling would compare {pairs} pairs of successes, over the limit of "
                    f"{budget.max_diverse_pairs} (max_diverse_pairs); ask for fewer questions per call"
                )
        out = []
        for qid, n in zip(question_ids, counts, strict=True):
            budget.keep_going()
            payloads = self._sample_by_attributes(prefix, qid, m, strategy, seed, min_version, budget) if n else []
            out.append((payloads, n))
        return out

    def _sample_uniform(
        self, pool: str, question_ids: Sequence[str], m: int, seed: int, min_version: int, budget: SampleBudget
    ) -> list[tuple[list[bytes], int]]:
        out: list[tuple[list[bytes], int]] = []
        per_call = max(1, UNIFORM_PICKS_PER_CALL // m)
        for start in range(0, len(question_ids), per_call):
            budget.keep_going()
            batch = question_ids[start : start + per_call]
            args: list[str | int] = [pool_prefix(pool), f"{ROOT}:pools", pool, min_version, m]
            for qid in batch:
                args += [qid, question_stream_seed(seed, qid)]
            flat = self._sample_uniform_script(args=args)
            if flat and flat[0] == -1:
                raise PoolNotFound(pool)
            cursor = 0
            for _ in batch:
                available, picked = int(flat[cursor]), int(flat[cursor + 1])
                payloads = flat[cursor + 2 : cursor + 2 + picked]
                budget.charge(payloads)
                out.append((payloads, available))
                cursor += 2 + picked
        return out

    def _sample_by_attributes(
        self, prefix: str, qid: str, m: int, strategy: Strategy, seed: int, min_version: int, budget: SampleBudget
    ) -> list[bytes]:
        qk = f"{prefix}:q:{qid}"
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebyscore(f"{qk}:ver", min_version, "+inf", withscores=True)
        pipe.zrange(f"{qk}:prio", 0, -1, withscores=True)
        versions, priorities = pipe.execute()
        priority = {tid: score for tid, score in priorities}
        payloads: dict[bytes, bytes] = {}
        if strategy == Strategy.DIVERSE:
            tids = [tid for tid, _ in versions]
            payloads = dict(zip(tids, self.client.hmget(f"{qk}:data", tids), strict=True)) if tids else {}
            budget.charge([p for p in payloads.values() if p])  # every candidate is read and decoded
            budget.keep_going()
        candidates = []
        for tid, version in versions:
            tokens: frozenset[int] = frozenset()
            if strategy == Strategy.DIVERSE and payloads.get(tid):
                traj = trajectory_pb2.Trajectory.FromString(payloads[tid])
                tokens = frozenset(traj.response_token_ids) or frozenset(traj.response_text.split())
            candidates.append(Candidate(tid.decode(), int(version), priority.get(tid, 1.0), tokens))
        chosen = choose(candidates, m, strategy, question_rng(seed, qid))
        if not chosen:
            return []
        if payloads:
            return [payloads[t.encode()] for t in chosen]
        read = [p for p in self.client.hmget(f"{qk}:data", chosen) if p]
        budget.charge(read)
        return read

    def update_priorities(
        self, pool: str, updates: Sequence[tuple[str, str, float]], keep_going: Callable[[], None] = _never_stop
    ) -> tuple[int, int]:
        """(question id, trajectory id or "" for all, priority) -> (updated, missing)."""
        self.require_pool(pool)
        prefix = pool_prefix(pool)
        updated = missing = 0
        # Two round trips per chunk, not two or three per update: a learner sends one per replayed row each step.
        for start in range(0, len(updates), PRIORITY_CHUNK):
            keep_going()
            chunk = updates[start : start + PRIORITY_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for qid, tid, _ in chunk:
                key = f"{prefix}:q:{qid}:prio"
                if tid:
                    pipe.zscore(key, tid)  # None when the trajectory is not there
                else:
                    pipe.zrange(key, 0, -1)  # every trajectory of the question
            found = pipe.execute()
            pipe = self.client.pipeline(transaction=False)
            for (qid, tid, priority), reply in zip(chunk, found, strict=True):
                present = ([tid] if reply is not None else []) if tid else [t.decode() for t in reply]
                if present:
                    pipe.zadd(f"{prefix}:q:{qid}:prio", {t: priority for t in present}, xx=True)
                updated += len(present)
                missing += int(not present)
            pipe.execute()
        return updated, missing

    def question_ids(self, pool: str) -> list[str]:
        self.require_pool(pool)
        return sorted(q.decode() for q in self.client.smembers(f"{pool_prefix(pool)}:questions"))

    def iter_questions(self, pool: str, batch: int = 256) -> Iterator[tuple[list[bytes], list[list[bytes]]]]:
        """Yields (question protos, per-question trajectory payloads in insertion order) in batches."""
        prefix = pool_prefix(pool)
        qids = self.question_ids(pool)
        for start in range(0, len(qids), batch):
            chunk = qids[start : start + batch]
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(f"{prefix}:qmeta", chunk)
            for qid in chunk:
                pipe.zrange(f"{prefix}:q:{qid}:ids", 0, -1)
            metas, *id_lists = pipe.execute()
            pipe = self.client.pipeline(transaction=False)
            for qid, ids in zip(chunk, id_lists, strict=True):
                pipe.hmget(f"{prefix}:q:{qid}:data", ids)  # every listed question holds >= 1 success
            payload_lists = pipe.execute()
            questions = [
                meta or replay_pb2.Question(question_id=qid).SerializeToString()
                for qid, meta in zip(chunk, metas, strict=True)
            ]
            yield questions, [[p for p in payloads if p] for payloads in payload_lists]

    def stats(self, pool: str) -> PoolCounters:
        """The pool's counters (`pool_stats` computes its figures from them): a few hashes of at most
        capacity + buckets + versions fields, whatever the pool's size (1 s for 10^6 questions was 30+ s when
        every question was read). A pool created before `counts` was kept is scanned question by question."""
        self.require_pool(pool)
        prefix = pool_prefix(pool)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(f"{prefix}:meta")
        pipe.hgetall(f"{prefix}:versions")
        pipe.hgetall(f"{prefix}:lengths")
        pipe.hgetall(f"{prefix}:counts")
        meta, versions, lengths, counts = pipe.execute()
        meta = {k.decode(): v.decode() for k, v in meta.items()}
        if "counted" in meta:
            by_successes = {int(k): int(v) for k, v in counts.items() if int(v) > 0}
        else:
            by_successes = self._scan_successes(pool)
        used_memory = int(self.client.info("memory").get("used_memory", 0))
        return PoolCounters(
            trajectories=int(meta.get("trajectories", 0)),
            tokens_sum=int(meta.get("tokens_sum", 0)),
            tokens_sq_sum=int(meta.get("tokens_sq_sum", 0)),
            payload_bytes=int(meta.get("payload_bytes", 0)),
            capacity=int(meta.get("capacity", 0)),
            eviction=meta.get("eviction", ""),
            successes_per_question=by_successes,
            length_buckets={k.decode(): int(v) for k, v in lengths.items() if int(v) > 0},
            policy_versions={int(k): int(v) for k, v in versions.items() if int(v) > 0},
            redis_used_memory_bytes=used_memory,
        )

    def _scan_successes(self, pool: str) -> dict[int, int]:
        """Successes -> questions, read question by question (O(questions)): pools created before `counts`."""
        if pool not in self._warned_scans:
            self._warned_scans.add(pool)
            log.warning(
                "pool %r predates the per-question counters: its stats read every question (slow for large "
                "pools); export and re-import it into a new pool to get constant-time stats",
                pool,
            )
        prefix = pool_prefix(pool)
        qids = self.client.smembers(f"{prefix}:questions")
        pipe = self.client.pipeline(transaction=False)
        for qid in qids:
            pipe.zcard(f"{prefix}:q:{qid.decode()}:ids")
        return dict(collections.Counter(int(c) for c in pipe.execute()))

    def drop(self, pool: str, keep_going: Callable[[], None] = _never_stop) -> int:
        """Deletes a pool's keys in batches; the name goes last, so a drop stopped midway can be run again."""
        self.require_pool(pool)
        prefix = pool_prefix(pool)
        total = int(self.client.hget(f"{prefix}:meta", "trajectories") or 0)
        keys = list(self.client.scan_iter(match=f"{prefix}:*", count=1000))  # pool names hold no glob characters
        for start in range(0, len(keys), 500):
            keep_going()
            self.client.unlink(*keys[start : start + 500])
        self.client.srem(f"{ROOT}:pools", pool)
        return total


def now_ms() -> int:
    return int(time.time() * 1000)
