"""gRPC adapter of the replay pool: proto <-> logic and store, request bounds, metrics.

Every request has a bounded cost, checked before the work where it can be: a Sample asks for at
most `max_sample_trajectories` (question ids x m), repeated question ids are sampled once, and
the reply's bytes stay under `max_sample_bytes`; diverse sampling compares at most
`max_diverse_pairs`. Work stops between units (a batch of picks, a question, a chunk, an update)
once the caller has cancelled or its deadline has passed. The checks live in `requests.py`, the
statistics in `pool_stats.py`, the error mapping in `errors.py`.

ReportOutcomes and GetQuestionStats keep and read each question's history (`history.py`; the checks in
`requests.py`, the proto conversion in `history_wire.py`); export and import carry it beside the successes.

ImportPool applies each chunk as its own atomic add, so an interrupted import leaves the chunks
that were applied; adds are idempotent, so running the same import again converges to the pool a
single run would have built (only eviction order can differ when a question overflows capacity).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry

from rlep.common.metrics import MetricFactory
from rlep.common.stream_guard import no_progress
from rlep.common.types import trajectory_id
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.errors import RedisHealth, keep_going_check, status_for_errors
from rlep.services.replay.history import HistoryCounters, HistoryStore
from rlep.services.replay.history_wire import add_history_stats, page_to_proto, record_to_proto
from rlep.services.replay.pool_stats import PoolStats, pool_stats
from rlep.services.replay.question_history import HistorySettings, pass_rate_bucket_labels
from rlep.services.replay.requests import (
    check_add,
    check_drop,
    check_histories,
    check_import_named_a_pool,
    check_pool_name,
    check_priority_updates,
    check_question_stats,
    check_reply_bytes,
    check_report,
    check_sample,
    export_chunk_questions,
    import_pool_name,
    trajectory_problem,
)
from rlep.services.replay.store import RedisReplayStore, SampleBudget, StoredTrajectory, now_ms

SERVICE = replay_pb2.DESCRIPTOR.services_by_name["ReplayBuffer"]
# An export chunk is cut past this many bytes (or `requests.MAX_QUESTIONS_PER_CHUNK` questions) so it
# stays well under gRPC's message limit.
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
        # Per-question history (issue 48), from the pool's counters after each report and at each stats call.
        self.pool_pass_rate_questions = m.gauge(
            "rlep_replay_pool_pass_rate_questions",
            "Questions with history per recent pass-rate bucket, per pool (pass_rate_bucket_labels)",
            ["pool", "bucket"],
        )
        self.pool_mastered_questions = m.gauge(
            "rlep_replay_pool_mastered_questions", "Questions mastered (see GetQuestionStats), per pool", ["pool"]
        )
        self.pool_rescues = m.gauge(
            "rlep_replay_pool_rescues", "Groups replay rescued (no fresh success), all time, per pool", ["pool"]
        )

    def show_history(self, pool: str, counters: HistoryCounters) -> None:
        if counters.settings is None:  # no report yet: no series, rather than zeros nobody measured
            return
        for label, count in zip(pass_rate_bucket_labels(), counters.pass_rate_buckets, strict=True):
            self.pool_pass_rate_questions.labels(pool, label).set(count)
        self.pool_mastered_questions.labels(pool).set(counters.mastered)
        self.pool_rescues.labels(pool).set(counters.rescues)


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
        settings = HistorySettings(
            config.history_window, config.history_ema_alpha, config.mastered_pass_rate, config.mastered_min_visits
        )
        self.history = HistoryStore(store.client, settings, config.max_history_runs)

    def _errors(self, context: grpc.ServicerContext, wrote: bool = False):
        return status_for_errors(self.metrics.redis_errors, self.redis_health, context, wrote)

    def _add(self, pool: str, trajectories, questions) -> replay_pb2.AddTrajectoriesResponse:
        check_add(pool, trajectories, questions, self.config)
        reply = replay_pb2.AddTrajectoriesResponse()
        items = []
        for index, traj in enumerate(trajectories):
            reason = trajectory_problem(traj, self.config.max_trajectory_bytes)
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
        return self._add(request.pool, request.trajectories, request.questions)

    @rpc()
    def Sample(self, request, context):
        started = time.perf_counter()
        strategy = check_sample(request, self.config)
        # A repeated id gets the same draw (it depends on seed and question only): sample it once.
        unique = list(dict.fromkeys(request.question_ids))
        budget = SampleBudget(self.config.max_sample_bytes, self.config.max_diverse_pairs, keep_going_check(context))
        results = self.store.sample(
            request.pool,
            unique,
            request.m,
            strategy,
            request.seed,
            request.min_policy_version,
            budget,
        )
        by_question = dict(zip(unique, results, strict=True))
        reply_bytes = sum(len(p) for qid in request.question_ids for p in by_question[qid][0])
        check_reply_bytes(reply_bytes, self.config.max_sample_bytes)
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
        check_priority_updates(request, self.config)
        updated, missing = self.store.update_priorities(
            request.pool,
            [(u.question_id, u.trajectory_id, u.priority) for u in request.updates],
            keep_going_check(context),
        )
        return replay_pb2.UpdatePrioritiesResponse(updated=updated, missing=missing)

    @rpc()
    def GetPoolStats(self, request, context):
        check_pool_name(request.pool)
        stats = pool_stats(self.store.stats(request.pool))
        self.metrics.pool_trajectories.labels(request.pool).set(stats.trajectories)
        self.metrics.pool_questions.labels(request.pool).set(stats.questions)
        reply = pool_stats_to_proto(request.pool, stats)
        counters = self.history.counters(request.pool)
        add_history_stats(reply, counters)
        self.metrics.show_history(request.pool, counters)
        return reply

    @rpc(wrote=True)
    def ReportOutcomes(self, request, context):
        outcomes = check_report(request, self.config)
        result = self.history.report(
            request.pool, request.run_id, request.step, request.policy_version, outcomes, request.questions
        )
        self.metrics.show_history(request.pool, self.history.counters(request.pool))
        return replay_pb2.ReportOutcomesResponse(
            recorded=result.recorded, duplicate=result.duplicate, last_step=result.last_step
        )

    @rpc()
    def GetQuestionStats(self, request, context):
        query = check_question_stats(request, self.config)
        if query.question_ids:
            return page_to_proto(self.history.named(request.pool, query.question_ids))
        return page_to_proto(self.history.page(request.pool, query))

    @rpc()
    def ListPools(self, request, context):
        return replay_pb2.ListPoolsResponse(pools=self.store.pools())

    @rpc()
    def DropPool(self, request, context):
        check_drop(request)
        deleted = self.store.drop(request.pool, keep_going_check(context))
        for gauge in (self.metrics.pool_trajectories, self.metrics.pool_questions):
            with contextlib.suppress(KeyError):  # no stats were taken of this pool
                gauge.remove(request.pool)
        return replay_pb2.DropPoolResponse(deleted_trajectories=deleted)

    def ExportPool(self, request, context) -> Iterator[replay_pb2.PoolChunk]:
        # A generator: errors surface while the stream is consumed, so the mapping wraps the loop.
        with self._errors(context):
            batch = export_chunk_questions(request)
            keep_going = keep_going_check(context)
            settings = self.history.counters(request.pool).settings  # NOT_FOUND for an unknown pool
            for questions, payload_lists in self.store.iter_questions(request.pool, batch):
                keep_going()
                chunk, size = replay_pb2.PoolChunk(pool=request.pool), 0
                for question, payloads in zip(questions, payload_lists, strict=True):
                    if chunk.questions and size > EXPORT_CHUNK_BYTES:
                        yield self._with_histories(request.pool, chunk, settings)
                        chunk, size = replay_pb2.PoolChunk(pool=request.pool), 0
                    size += len(question) + sum(len(p) for p in payloads)
                    chunk.questions.add().MergeFromString(question)
                    for payload in payloads:
                        chunk.trajectories.add().MergeFromString(payload)
                yield self._with_histories(request.pool, chunk, settings)
            # Then the questions with history and no success, with their Question where the pool has one.
            for metas, records in self.history.iter_history_only(request.pool, batch):
                keep_going()
                chunk, size = replay_pb2.PoolChunk(pool=request.pool), 0
                for meta, record in zip(metas, records, strict=True):
                    if chunk.histories and size > EXPORT_CHUNK_BYTES:
                        yield chunk
                        chunk, size = replay_pb2.PoolChunk(pool=request.pool), 0
                    if meta:
                        chunk.questions.add().MergeFromString(meta)
                    chunk.histories.append(record_to_proto(record, settings))
                    size += len(meta or b"") + chunk.histories[-1].ByteSize()
                yield chunk

    def _with_histories(
        self, pool: str, chunk: replay_pb2.PoolChunk, settings: HistorySettings | None
    ) -> replay_pb2.PoolChunk:
        """The chunk with the histories of its questions (those that have one)."""
        records = self.history.records(pool, [q.question_id for q in chunk.questions])
        chunk.histories.extend(record_to_proto(r, settings) for r in records if r is not None)
        return chunk

    @rpc(wrote=True)
    def ImportPool(self, request_iterator, context):
        """Each chunk is one atomic, idempotent add: re-running an interrupted import converges."""
        total = replay_pb2.AddTrajectoriesResponse()
        pool = ""
        keep_going = keep_going_check(context)
        for chunk in request_iterator:
            keep_going()
            pool = import_pool_name(pool, chunk)
            if not chunk.questions and not chunk.trajectories and not chunk.histories:
                # Naming the pool is no progress: chunks of nothing sent just under the idle timeout would
                # otherwise hold a stream slot (and a thread) for as long as the client likes.
                no_progress()
            records = check_histories(chunk.histories, self.config)  # before the add: a bad chunk stores nothing
            reply = self._add(pool, chunk.trajectories, chunk.questions)
            imported, kept = self.history.import_records(pool, records)
            total.histories_imported += imported
            total.histories_kept += kept
            offset = total.added + total.duplicate + total.rejected
            total.added += reply.added
            total.duplicate += reply.duplicate
            total.evicted += reply.evicted
            total.rejected += reply.rejected
            for rejection in reply.rejections:
                total.rejections.add(index=offset + rejection.index, reason=rejection.reason)
        check_import_named_a_pool(pool)
        return total


def pool_stats_to_proto(pool: str, stats: PoolStats) -> replay_pb2.PoolStats:
    reply = replay_pb2.PoolStats(
        pool=pool,
        questions=stats.questions,
        trajectories=stats.trajectories,
        mean_response_tokens=stats.mean_response_tokens,
        std_response_tokens=stats.std_response_tokens,
        payload_bytes=stats.payload_bytes,
        redis_used_memory_bytes=stats.redis_used_memory_bytes,
        capacity_per_question=stats.capacity_per_question,
        eviction=stats.eviction,
    )
    for histogram, rows in (
        (reply.successes_per_question, stats.successes_per_question),
        (reply.response_token_histogram, stats.response_token_histogram),
        (reply.per_policy_version, stats.per_policy_version),
    ):
        for label, count in rows:
            histogram.add(label=label, count=count)
    return reply
