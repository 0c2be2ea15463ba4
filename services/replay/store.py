"""Redis storage of replay pools: the key schema, atomic idempotent adds, O(M) uniform sampling.

Key schema (the `{pool}` braces are a Redis Cluster hash tag: a pool's keys share one slot, so
its Lua scripts stay valid on a cluster):

    rlep:replay:pools                      SET   pool names
    rlep:replay:{P}:meta                   HASH  capacity, eviction, seq, trajectories, payload_bytes,
                                                 tokens_sum, tokens_sq_sum
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
duplicate is detected atomically. Uniform sampling of a whole step is one Lua call: per question
it counts the successes, draws M distinct indices with a seeded LCG and reads exactly those
entries (ZRANGE by rank + HGET): one round trip per step, O(M log n) per question.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import redis

from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2
from services.replay.core import (
    Candidate,
    Eviction,
    Strategy,
    choose,
    length_bucket,
    question_rng,
    question_stream_seed,
)

ROOT = "rlep:replay"

ADD_SCRIPT = """
local p, pools_key, pool = ARGV[1], ARGV[2], ARGV[3]
local cap, eviction, nq = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local meta = p .. ':meta'
redis.call('SADD', pools_key, pool)
redis.call('HSETNX', meta, 'capacity', cap)
redis.call('HSETNX', meta, 'eviction', eviction)
local i = 7
for _ = 1, nq do
  redis.call('HSET', p .. ':qmeta', ARGV[i], ARGV[i + 1])
  i = i + 2
end
local function remove(qk, tid)
  local aux = redis.call('HGET', qk .. ':aux', tid)
  local ver, len, bytes, bucket = string.match(aux, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  len = tonumber(len)
  redis.call('HDEL', qk .. ':data', tid)
  redis.call('HDEL', qk .. ':aux', tid)
  redis.call('ZREM', qk .. ':ids', tid)
  redis.call('ZREM', qk .. ':ver', tid)
  redis.call('ZREM', qk .. ':prio', tid)
  redis.call('HINCRBY', meta, 'trajectories', -1)
  redis.call('HINCRBY', meta, 'payload_bytes', -tonumber(bytes))
  redis.call('HINCRBY', meta, 'tokens_sum', -len)
  redis.call('HINCRBY', meta, 'tokens_sq_sum', -len * len)
  redis.call('HINCRBY', p .. ':versions', ver, -1)
  redis.call('HINCRBY', p .. ':lengths', bucket, -1)
end
local added, duplicate, evicted = 0, 0, 0
local status = {}
while i <= #ARGV do
  local qid, tid, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local prio, ver, len, bucket = ARGV[i + 3], ARGV[i + 4], tonumber(ARGV[i + 5]), ARGV[i + 6]
  i = i + 7
  local qk = p .. ':q:' .. qid
  if redis.call('HEXISTS', qk .. ':data', tid) == 1 then
    duplicate = duplicate + 1
  else
    local seq = redis.call('HINCRBY', meta, 'seq', 1)
    redis.call('HSET', qk .. ':data', tid, payload)
    redis.call('HSET', qk .. ':aux', tid, ver .. '|' .. len .. '|' .. #payload .. '|' .. bucket)
    redis.call('ZADD', qk .. ':ids', seq, tid)
    redis.call('ZADD', qk .. ':ver', ver, tid)
    redis.call('ZADD', qk .. ':prio', prio, tid)
    redis.call('SADD', p .. ':questions', qid)
    redis.call('HINCRBY', meta, 'trajectories', 1)
    redis.call('HINCRBY', meta, 'payload_bytes', #payload)
    redis.call('HINCRBY', meta, 'tokens_sum', len)
    redis.call('HINCRBY', meta, 'tokens_sq_sum', len * len)
    redis.call('HINCRBY', p .. ':versions', ver, 1)
    redis.call('HINCRBY', p .. ':lengths', bucket, 1)
    added = added + 1
    if redis.call('ZCARD', qk .. ':ids') > tonumber(redis.call('HGET', meta, 'capacity')) then
      local order = redis.call('HGET', meta, 'eviction') == 'oldest' and ':ids' or ':prio'
      remove(qk, redis.call('ZRANGE', qk .. order, 0, 0)[1])
      evicted = evicted + 1
    end
  end
end
return {added, duplicate, evicted}
"""

# Uniform sampling for a whole step in one call. ARGV: prefix, pools key, pool, min_version, m,
# then (question id, LCG seed) pairs. Returns {-1} for an unknown pool, else per question:
# available, picked, payload... The index draw mirrors core.choose_uniform_indices exactly.
SAMPLE_UNIFORM_SCRIPT = """
local p, pools_key, pool = ARGV[1], ARGV[2], ARGV[3]
if redis.call('SISMEMBER', pools_key, pool) == 0 then return {-1} end
local min_version, m = tonumber(ARGV[4]), tonumber(ARGV[5])
local out = {}
for a = 6, #ARGV, 2 do
  local key = p .. ':q:' .. ARGV[a] .. ':ver'
  local n = min_version > 0 and redis.call('ZCOUNT', key, min_version, '+inf') or redis.call('ZCARD', key)
  local k = math.min(m, n)
  out[#out + 1] = n
  out[#out + 1] = k
  local state, swapped = tonumber(ARGV[a + 1]), {}
  for i = 0, k - 1 do
    state = (state * 48271) % 2147483647
    local j = i + state % (n - i)
    local index = swapped[j] or j
    swapped[j] = swapped[i] or i
    local tid
    if min_version > 0 then
      tid = redis.call('ZRANGEBYSCORE', key, min_version, '+inf', 'LIMIT', index, 1)[1]
    else
      tid = redis.call('ZRANGE', key, index, index)[1]
    end
    out[#out + 1] = redis.call('HGET', p .. ':q:' .. ARGV[a] .. ':data', tid)
  end
end
return out
"""


class PoolNotFound(KeyError):
    pass


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


class RedisReplayStore:
    """Replay pools in one Redis. Thread-safe (redis-py's connection pool)."""

    def __init__(self, client: redis.Redis, capacity_per_question: int, eviction: Eviction):
        self.client = client
        self.capacity = capacity_per_question
        self.eviction = eviction
        self._add = client.register_script(ADD_SCRIPT)
        self._sample_uniform_script = client.register_script(SAMPLE_UNIFORM_SCRIPT)

    def pools(self) -> list[str]:
        return sorted(m.decode() for m in self.client.smembers(f"{ROOT}:pools"))

    def require_pool(self, pool: str) -> None:
        if not self.client.sismember(f"{ROOT}:pools", pool):
            raise PoolNotFound(pool)

    def add(self, pool: str, items: Sequence[StoredTrajectory], questions: Sequence[replay_pb2.Question]) -> AddResult:
        args: list[bytes | str | int | float] = [
            pool_prefix(pool),
            f"{ROOT}:pools",
            pool,
            self.capacity,
            self.eviction.value,
            len(questions),
        ]
        for question in questions:
            args += [question.question_id, question.SerializeToString()]
        for item in items:
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
        return AddResult(int(added), int(duplicate), int(evicted))

    def sample(
        self, pool: str, question_ids: Sequence[str], m: int, strategy: Strategy, seed: int, min_version: int = 0
    ) -> list[tuple[list[bytes], int]]:
        """Per question: (payloads of up to m distinct successes, successes available)."""
        if strategy == Strategy.UNIFORM:
            return self._sample_uniform(pool, question_ids, m, seed, min_version)
        self.require_pool(pool)
        prefix = pool_prefix(pool)
        pipe = self.client.pipeline(transaction=False)
        for qid in question_ids:
            pipe.zcount(f"{prefix}:q:{qid}:ver", min_version, "+inf")
        counts = [int(c) for c in pipe.execute()]
        return [
            (self._sample_by_attributes(prefix, qid, m, strategy, seed, min_version) if n else [], n)
            for qid, n in zip(question_ids, counts, strict=True)
        ]

    def _sample_uniform(
        self, pool: str, question_ids: Sequence[str], m: int, seed: int, min_version: int
    ) -> list[tuple[list[bytes], int]]:
        args: list[str | int] = [pool_prefix(pool), f"{ROOT}:pools", pool, min_version, m]
        for qid in question_ids:
            args += [qid, question_stream_seed(seed, qid)]
        flat = self._sample_uniform_script(args=args)
        if flat and flat[0] == -1:
            raise PoolNotFound(pool)
        out, cursor = [], 0
        for _ in question_ids:
            available, picked = int(flat[cursor]), int(flat[cursor + 1])
            out.append((flat[cursor + 2 : cursor + 2 + picked], available))
            cursor += 2 + picked
        return out

    def _sample_by_attributes(
        self, prefix: str, qid: str, m: int, strategy: Strategy, seed: int, min_version: int
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
        return [p for p in self.client.hmget(f"{qk}:data", chosen) if p]

    def update_priorities(self, pool: str, updates: Sequence[tuple[str, str, float]]) -> tuple[int, int]:
        """(question id, trajectory id or "" for all, priority) -> (updated, missing)."""
        self.require_pool(pool)
        prefix = pool_prefix(pool)
        updated = missing = 0
        for qid, tid, priority in updates:
            key = f"{prefix}:q:{qid}:prio"
            tids = [tid] if tid else [t.decode() for t in self.client.zrange(key, 0, -1)]
            present = [t for t in tids if self.client.zscore(key, t) is not None]
            if present:
                self.client.zadd(key, {t: priority for t in present}, xx=True)
            updated += len(present)
            missing += (len(tids) - len(present)) if tid else int(not present)
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

    def stats(self, pool: str) -> dict:
        self.require_pool(pool)
        prefix = pool_prefix(pool)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(f"{prefix}:meta")
        pipe.hgetall(f"{prefix}:versions")
        pipe.hgetall(f"{prefix}:lengths")
        pipe.smembers(f"{prefix}:questions")
        meta, versions, lengths, qids = pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for qid in qids:
            pipe.zcard(f"{prefix}:q:{qid.decode()}:ids")
        per_question = pipe.execute()
        used_memory = int(self.client.info("memory").get("used_memory", 0))
        return {
            "meta": {k.decode(): v.decode() for k, v in meta.items()},
            "versions": {int(k): int(v) for k, v in versions.items() if int(v) > 0},
            "lengths": {k.decode(): int(v) for k, v in lengths.items() if int(v) > 0},
            "per_question": [int(c) for c in per_question],
            "used_memory": used_memory,
        }

    def drop(self, pool: str) -> int:
        self.require_pool(pool)
        prefix = pool_prefix(pool)
        total = int(self.client.hget(f"{prefix}:meta", "trajectories") or 0)
        keys = list(self.client.scan_iter(match=f"{prefix}:*", count=1000))  # pool names hold no glob characters
        for start in range(0, len(keys), 500):
            self.client.unlink(*keys[start : start + 500])
        self.client.srem(f"{ROOT}:pools", pool)
        return total


def now_ms() -> int:
    return int(time.time() * 1000)
