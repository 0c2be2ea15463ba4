"""Per-question history's pure parts: the record's stored form, the pass-rate index keys, query checks."""

from __future__ import annotations

import random

import pytest

from rlep.replay.v1 import replay_pb2
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.question_history import QuestionFilter, QuestionRecord, pass_rate_bucket_labels, rate_key
from rlep.services.replay.requests import InvalidRequest, check_question_stats, history_record


def record(**fields) -> QuestionRecord:
    base = dict(
        question_id="q",
        visits=3,
        attempts=12,
        successes=5,
        reward_sum=-2.5,
        ema=0.3125,
        first_step=10,
        last_step=2**53 - 1,
        first_version=3,
        last_version=4,
        times_replayed=2,
        replayed_rows=4,
        times_rescued=1,
        last_solved_step=-1,
        window_attempts=(4, 4, 4),
        window_successes=(1, 0, 4),
    )
    return QuestionRecord(**(base | fields))


def test_a_record_survives_its_stored_form_exactly():
    original = record(ema=1 / 3, reward_sum=-0.1)
    assert QuestionRecord.decode("q", original.encode()) == original
    assert original.pass_rate == 5 / 12


def test_rate_keys_sort_as_the_rates_do():
    rng = random.Random(0)
    rates = [0.0, 1.0, 0.5, 0.25, 1 / 3] + [rng.random() for _ in range(2000)]
    assert sorted(rates, key=rate_key) == sorted(rates)
    assert all(len(rate_key(r)) == 16 for r in rates)


def test_pass_rate_buckets_are_ten_tenths():
    labels = pass_rate_bucket_labels()
    assert labels[0] == "0.0-0.1" and labels[-1] == "0.9-1.0" and len(labels) == 10


def test_question_queries_default_and_check_their_cursor():
    config = ReplayConfig()
    query = check_question_stats(replay_pb2.GetQuestionStatsRequest(pool="p"), config)
    assert (query.filter, query.limit, query.min_pass_rate, query.max_pass_rate) == (QuestionFilter.ALL, 100, 0, 1)
    cursor = rate_key(0.5) + ":q7"
    assert check_question_stats(replay_pb2.GetQuestionStatsRequest(pool="p", cursor=cursor), config).cursor == cursor
    for bad in ("q7", rate_key(0.5) + ":", "Z" * 16 + ":q"):
        with pytest.raises(InvalidRequest, match="cursor"):
            check_question_stats(replay_pb2.GetQuestionStatsRequest(pool="p", cursor=bad), config)


def test_an_imported_history_with_impossible_values_is_refused():
    good = replay_pb2.QuestionHistory(
        question_id="q", visits=1, attempts=4, successes=1, ema_pass_rate=0.25, last_solved_step=3
    )
    good.window_attempts.append(4)
    good.window_successes.append(1)
    assert history_record(good).pass_rate == 0.25
    for change in (
        {"successes": 5},
        {"visits": 0},
        {"ema_pass_rate": float("nan")},
        {"reward_sum": float("inf")},
        {"first_step": -1},
        {"last_solved_step": -2},
    ):
        bad = replay_pb2.QuestionHistory()
        bad.CopyFrom(good)
        for name, value in change.items():
            setattr(bad, name, value)
        with pytest.raises(InvalidRequest):
            history_record(bad)
    uneven = replay_pb2.QuestionHistory()
    uneven.CopyFrom(good)
    uneven.window_successes.append(0)
    with pytest.raises(InvalidRequest, match="window"):
        history_record(uneven)
