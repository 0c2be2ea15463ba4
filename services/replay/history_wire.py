"""Per-question history <-> the replay proto: records as QuestionHistory, a pool's history counters in PoolStats."""

from __future__ import annotations

from rlep.replay.v1 import replay_pb2
from rlep.services.replay.history import HistoryCounters, Page
from rlep.services.replay.question_history import HistorySettings, QuestionRecord, pass_rate_bucket_labels


def record_to_proto(record: QuestionRecord, settings: HistorySettings | None) -> replay_pb2.QuestionHistory:
    """`settings`: the pool's (mastered is judged by them); None only for a pool without history."""
    return replay_pb2.QuestionHistory(
        question_id=record.question_id,
        visits=record.visits,
        attempts=record.attempts,
        successes=record.successes,
        reward_sum=record.reward_sum,
        window_attempts=record.window_attempts,
        window_successes=record.window_successes,
        pass_rate=record.pass_rate,
        ema_pass_rate=record.ema,
        first_step=record.first_step,
        last_step=record.last_step,
        first_policy_version=record.first_version,
        last_policy_version=record.last_version,
        times_replayed=record.times_replayed,
        replayed_rows=record.replayed_rows,
        times_rescued=record.times_rescued,
        last_solved_step=record.last_solved_step,
        mastered=settings is not None and record.mastered(settings),
    )


def page_to_proto(page: Page) -> replay_pb2.GetQuestionStatsResponse:
    return replay_pb2.GetQuestionStatsResponse(
        questions=[record_to_proto(r, page.settings) for r in page.records],
        next_cursor=page.next_cursor,
        matching=page.matching,
    )


def add_history_stats(reply: replay_pb2.PoolStats, counters: HistoryCounters) -> None:
    """Fills PoolStats' history fields (the histogram only once the pool has history)."""
    reply.questions_with_history = counters.questions
    reply.rescues = counters.rescues
    reply.mastered_questions = counters.mastered
    reply.never_solved_questions = counters.never_solved
    reply.history_reports = counters.reports
    reply.replayed_rows = counters.replayed_rows
    if counters.settings is None:
        return
    for label, count in zip(pass_rate_bucket_labels(), counters.pass_rate_buckets, strict=True):
        reply.pass_rate_histogram.add(label=label, count=count)
    s = counters.settings
    reply.history_settings.CopyFrom(
        replay_pb2.HistorySettings(
            window=s.window,
            ema_alpha=s.ema_alpha,
            mastered_pass_rate=s.mastered_pass_rate,
            mastered_min_visits=s.mastered_min_visits,
        )
    )
