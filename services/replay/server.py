"""gRPC adapter of the replay pool: validation, request bounds, proto <-> store, metrics.

Every request has a bounded cost, checked before the work where it can be: a Sample asks for at
most `max_sample_trajectories` (question ids x m), repeated question ids are sampled once, and
the reply's bytes stay under `max_sample_bytes`; diverse sampling compares at most
`max_diverse_pairs`. Work stops between units (a batch of picks, a question, a chunk, an update)
once the caller has cancelled or its deadline has passed. Error mapping lives in `errors.py`.

ImportPool applies each chunk as its own atomic add, so an interrupted import leaves the chunks
that were applied; adds are idempotent, so running the same import again converges to the pool a
single run would have built (only eviction order can differ when a question overflows capacity).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import time
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry

from rlep.common.grpc_utils import check_request_size
from rlep.common.metrics import MetricFactory
from rlep.common.types import trajectory_id
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.errors import RedisHealth, keep_going_check, status_for_errors
from rlep.services.replay.sampling import Strategy, check_pool_name, check_question_id, question_id_problem
from rlep.services.replay.store import LimitExceeded, RedisReplayStore, SampleBudget, StoredTrajectory, now_ms

SERVICE = replay_pb2.DESCRIPTOR.services_by_name["ReplayBuffer"]
STRATEGIES = {
    replay_pb2.STRATEGY_UNSPECIFIED: Strategy.UNIFORM,
    replay_pb2.UNIFORM: Strategy.UNIFORM,
    replay_pb2.RECENCY: Strategy.RECENCY,
    replay_pb2.PRIORITIZED: Strategy.PRIORITIZED,
    replay_pb2.DIVERSE: Strategy.DIVERSE,
}
MAX_FINGERPRINT_CHARS = 64
# An export chunk holds at most this many questions, and is cut earlier past EXPORT_CHUNK_BYTES
# so it stays well under gRPC's message limit.
MAX_QUESTIONS_PER_CHUNK = 4096
EXPORT_CHUNK_BYTES = 16 * 1024 * 1024


class ReplayMetrics:
    """The replay service's Prometheus series (`rlep_replay_*`)."""

    def __init__(self, registry: CollectorRegistry):
        m = MetricFactory(registry)
        self.adds = m.counter(
            "rlep_replay_trajectories_added_total",
            "Trajectories offered to AddTrajectories, by outcome",
            ["outcome"],
            ("added", "duplicate", "rejected", "evicted"),
        )
        self.sample_seconds = m.histogram(
            "rlep_replay_sample_seconds",
            "Latency of a Sample call",
            (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.sampled = m.counter("rlep_replay_sampled_trajectories_total", "Trajectories returned by Sample")
        self.redis_errors = m.counter("rlep_replay_redis_errors_total", "Redis calls that failed")
        self.pool_trajectories = m.gauge(
            "rlep_replay_pool_trajectories", "Trajectories stored, per pool (at last stats)", ["pool"]
        )
        self.pool_questions = m.gauge(
            "rlep_replay_pool_questions", "Questions covered, per pool (at last stats)", ["pool"]
        )
        self.requests = m.counter(  # counted by the server's StatusCountInterceptor
            "rlep_replay_requests_total", "RPCs by method and status code", ["method", "code"]
        )


def rpc(wrote: bool = False):
    """Runs a unary-response handler under `status_for_errors`; `wrote`: the method writes to Redis."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, request, context):
            with self._errors(context, wrote):
                return method(self, request, context)

        return wrapper

    return decorate


class ReplayServicer(replay_pb2_grpc.ReplayBufferServicer):
    def __init__(self, store: RedisReplayStore, config: ReplayConfig, metrics: ReplayMetrics):
        self.store, self.config, self.metrics = store, config, metrics
        self.redis_health = RedisHealth()

    def _errors(self, context: grpc.ServicerContext, wrote: bool = False):
        return status_for_errors(self.metrics.redis_errors, self.redis_health, context, wrote)

    def _validate(self, traj: trajectory_pb2.Trajectory) -> str | None:
        """Why a trajectory cannot be stored, or None."""
        if problem := question_id_problem(traj.question_id):
            return problem
        if not traj.response_text:
            return "missing response_text"
        if traj.verdict not in trajectory_pb2.Verdict.values():
            return f"unknown verdict {traj.verdict}"
        if traj.verdict != trajectory_pb2.CORRECT:
            return f"not a success (verdict {trajectory_pb2.Verdict.Name(traj.verdict)}); the pool keeps CORRECT only"
        if len(traj.tokenizer_fingerprint) > MAX_FINGERPRINT_CHARS:
            return f"tokenizer_fingerprint longer than {MAX_FINGERPRINT_CHARS} characters"
        if traj.behavior_logprobs and len(traj.behavior_logprobs) != len(traj.response_token_ids):
            return "behavior_logprobs and response_token_ids differ in length"
        if not all(map(math.isfinite, traj.behavior_logprobs)):  # a NaN would reach the learner's IS weights
            return "behavior_logprobs must be finite"
        if traj.ByteSize() > self.config.max_trajectory_bytes:
            return f"oversize: {traj.ByteSize()} bytes > {self.config.max_trajectory_bytes}"
        return None

    def _check_add(self, pool: str, trajectories, questions) -> None:
        """Whole-request checks: counts, question metadata, rewards (INVALID_ARGUMENT, nothing stored)."""
        check_pool_name(pool)
        if len(trajectories) > self.config.max_trajectories_per_add:
            raise ValueError(
                f"{len(trajectories)} trajectories in one call, over {self.config.max_trajectories_per_add}"
            )
        if len(questions) > self.config.max_trajectories_per_add:
            raise ValueError(f"{len(questions)} questions in one call, over {self.config.max_trajectories_per_add}")
        for index, question in enumerate(questions):
            check_question_id(question.question_id, f"questions[{index}]")
            if question.ByteSize() > self.config.max_question_bytes:
                raise ValueError(
                    f"questions[{index}] is {question.ByteSize()} bytes, over max_question_bytes "
                    f"{self.config.max_question_bytes}"
                )
        for index, traj in enumerate(trajectories):
            # A NaN reward would be stored as a success and poison every advantage it is mixed into.
            if not math.isfinite(traj.reward):
                raise ValueError(f"trajectories[{index}].reward is {traj.reward}; rewards must be finite")

    def _add(self, pool: str, trajectories, questions) -> replay_pb2.AddTrajectoriesResponse:
        self._check_add(pool, trajectories, questions)
        reply = replay_pb2.AddTrajectoriesResponse()
        items = []
        for index, traj in enumerate(trajectories):
            reason = self._validate(traj)
            if reason:
                reply.rejections.add(index=index, reason=reason)
                continue
            stored = trajectory_pb2.Trajectory()
            stored.CopyFrom(traj)
            if not stored.created_at_ms:
                stored.created_at_ms = now_ms()
            tokens = len(traj.response_token_ids) or len(traj.response_text.split())
            items.append(
                StoredTrajectory(
                    traj.question_id,
                    trajectory_id(traj.question_id, traj.response_text),
                    stored.SerializeToString(),
                    1.0,
                    traj.policy_version,
                    tokens,
                )
            )
        result = self.store.add(pool, items, list(questions))
        reply.added, reply.duplicate, reply.evicted = result.added, result.duplicate, result.evicted
        reply.rejected = len(reply.rejections)
        for outcome, count in (
            ("added", reply.added),
            ("duplicate", reply.duplicate),
            ("rejected", reply.rejected),
            ("evicted", reply.evicted),
        ):
            self.metrics.adds.labels(outcome).inc(count)
        return reply

    @rpc(wrote=True)
    def AddTrajectories(self, request, context):
        check_request_size(request, context, self.config.server.max_request_bytes)
        return self._add(request.pool, request.trajectories, request.questions)

    def _check_sample(self, request) -> None:
        check_pool_name(request.pool)
        if not 1 <= request.m <= self.config.max_m:
            raise ValueError(f"m must be in 1..{self.config.max_m}, got {request.m}")
        if not request.question_ids:
            raise ValueError("question_ids is empty")
        if len(request.question_ids) > self.config.max_questions_per_sample:
            raise ValueError(f"{len(request.question_ids)} question ids, over {self.config.max_questions_per_sample}")
        if request.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {request.strategy}")
        for index, qid in enumerate(request.question_ids):
            check_question_id(qid, f"question_ids[{index}]")
        asked = len(request.question_ids) * request.m
        if asked > self.config.max_sample_trajectories:
            raise LimitExceeded(
                f"the call asks for up to {asked} trajectories (question ids x m), over the limit of "
                f"{self.config.max_sample_trajectories} (max_sample_trajectories); split it"
            )

    @rpc()
    def Sample(self, request, context):
        started = time.perf_counter()
        self._check_sample(request)
        # A repeated id gets the same draw (it depends on seed and question only): sample it once.
        unique = list(dict.fromkeys(request.question_ids))
        budget = SampleBudget(self.config.max_sample_bytes, self.config.max_diverse_pairs, keep_going_check(context))
        results = self.store.sample(
            request.pool,
            unique,
            request.m,
            STRATEGIES[request.strategy],
            request.seed,
            request.min_policy_version,
            budget,
        )
        by_question = dict(zip(unique, results, strict=True))
        reply_bytes = sum(len(p) for qid in request.question_ids for p in by_question[qid][0])
        if reply_bytes > self.config.max_sample_bytes:
            raise LimitExceeded(
                f"the reply would hold {reply_bytes} bytes of trajectories, over the limit of "
                f"{self.config.max_sample_bytes} (max_sample_bytes); ask for fewer questions per call or a smaller m"
            )
        reply = replay_pb2.SampleResponse()
        returned = 0
        for qid in request.question_ids:
            payloads, available = by_question[qid]
            if request.trajectories_as_bytes:
                # The stored bytes go out as they are: parsing and re-encoding ~1 MB per step cost more
                # than the rest of the handler. They were validated and serialized by `_add`.
                reply.samples.add(question_id=qid, available=available, trajectory_bytes=payloads)
            else:
                sample = reply.samples.add(question_id=qid, available=available)
                for payload in payloads:
                    sample.trajectories.add().MergeFromString(payload)
            reply.short_questions += len(payloads) < request.m
            returned += len(payloads)
        self.metrics.sampled.inc(returned)
        self.metrics.sample_seconds.observe(time.perf_counter() - started)
        return reply

    @rpc(wrote=True)
    def UpdatePriorities(self, request, context):
        check_pool_name(request.pool)
        if len(request.updates) > self.config.max_trajectories_per_add:
            raise ValueError(f"{len(request.updates)} updates in one call, over {self.config.max_trajectories_per_add}")
        for update in request.updates:
            if not update.priority > 0 or not math.isfinite(update.priority):
                raise ValueError(f"priority must be finite and > 0, got {update.priority} for {update.question_id!r}")
            check_question_id(update.question_id, "updates")
        updated, missing = self.store.update_priorities(
            request.pool,
            [(u.question_id, u.trajectory_id, u.priority) for u in request.updates],
            keep_going_check(context),
        )
        return replay_pb2.UpdatePrioritiesResponse(updated=updated, missing=missing)

    @rpc()
    def GetPoolStats(self, request, context):
        check_pool_name(request.pool)
        raw = self.store.stats(request.pool)
        meta = raw["meta"]
        total = int(meta.get("trajectories", 0))
        tokens_sum, tokens_sq = int(meta.get("tokens_sum", 0)), int(meta.get("tokens_sq_sum", 0))
        mean = tokens_sum / total if total else 0.0
        var = max(tokens_sq / total - mean * mean, 0.0) if total else 0.0
        histogram = collections.Counter(raw["per_question"])  # successes per question -> questions
        stats = replay_pb2.PoolStats(
            pool=request.pool,
            questions=len(raw["per_question"]),
            trajectories=total,
            mean_response_tokens=mean,
            std_response_tokens=var**0.5,
            payload_bytes=int(meta.get("payload_bytes", 0)),
            redis_used_memory_bytes=raw["used_memory"],
            capacity_per_question=int(meta.get("capacity", 0)),
            eviction=meta.get("eviction", ""),
        )
        for count in sorted(histogram):
            stats.successes_per_question.add(label=str(count), count=histogram[count])
        for label in sorted(raw["lengths"], key=lambda b: int(b.split("-")[0])):
            stats.response_token_histogram.add(label=label, count=raw["lengths"][label])
        for version in sorted(raw["versions"]):
            stats.per_policy_version.add(label=str(version), count=raw["versions"][version])
        self.metrics.pool_trajectories.labels(request.pool).set(total)
        self.metrics.pool_questions.labels(request.pool).set(stats.questions)
        return stats

    @rpc()
    def ListPools(self, request, context):
        return replay_pb2.ListPoolsResponse(pools=self.store.pools())

    @rpc()
    def DropPool(self, request, context):
        check_pool_name(request.pool)
        if request.confirm != request.pool:
            raise ValueError("DropPool needs confirm equal to the pool name")
        deleted = self.store.drop(request.pool, keep_going_check(context))
        for gauge in (self.metrics.pool_trajectories, self.metrics.pool_questions):
            with contextlib.suppress(KeyError):  # no stats were taken of this pool
                gauge.remove(request.pool)
        return replay_pb2.DropPoolResponse(deleted_trajectories=deleted)

    def ExportPool(self, request, context) -> Iterator[replay_pb2.PoolChunk]:
        # A generator: errors surface while the stream is consumed, so the mapping wraps the loop.
        with self._errors(context):
            check_pool_name(request.pool)
            if not 0 <= request.questions_per_chunk <= MAX_QUESTIONS_PER_CHUNK:
                raise ValueError(
                    f"questions_per_chunk must be in 1..{MAX_QUESTIONS_PER_CHUNK} (0: 256), "
                    f"got {request.questions_per_chunk}"
                )
            batch = request.questions_per_chunk or 256
            keep_going = keep_going_check(context)
            for questions, payload_lists in self.store.iter_questions(request.pool, batch):
                keep_going()
                chunk, size = replay_pb2.PoolChunk(pool=request.pool), 0
                for question, payloads in zip(questions, payload_lists, strict=True):
                    if chunk.questions and size > EXPORT_CHUNK_BYTES:
                        yield chunk
                        chunk, size = replay_pb2.PoolChunk(pool=request.pool), 0
                    size += len(question) + sum(len(p) for p in payloads)
                    chunk.questions.add().MergeFromString(question)
                    for payload in payloads:
                        chunk.trajectories.add().MergeFromString(payload)
                yield chunk

    @rpc(wrote=True)
    def ImportPool(self, request_iterator, context):
        """Each chunk is one atomic, idempotent add: re-running an interrupted import converges."""
        total = replay_pb2.AddTrajectoriesResponse()
        pool = ""
        keep_going = keep_going_check(context)
        for chunk in request_iterator:
            keep_going()
            pool = pool or chunk.pool
            if chunk.pool and chunk.pool != pool:
                raise ValueError("every chunk of one import must name the same pool")
            check_request_size(chunk, context, self.config.server.max_request_bytes)
            reply = self._add(pool, chunk.trajectories, chunk.questions)
            offset = total.added + total.duplicate + total.rejected
            total.added += reply.added
            total.duplicate += reply.duplicate
            total.evicted += reply.evicted
            total.rejected += reply.rejected
            for rejection in reply.rejections:
                total.rejections.add(index=offset + rejection.index, reason=rejection.reason)
        if not pool:
            raise ValueError("ImportPool needs at least one chunk naming the pool")
        return total
