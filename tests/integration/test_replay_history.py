"""Per-question history (issue 48, part 1) against a real replay server and Redis: reports, the record each question
keeps (window, EMA, mastered), pages and filters, the duplicate rule, hostile reports and queries, DropPool."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from rlep.common.types import Trajectory, Verdict
from rlep.replay.v1 import replay_pb2
from rlep.services.replay.types import PoolNotFound

pytestmark = pytest.mark.integration

# The session fixture's replay uses the config defaults: window 8, alpha 0.25, mastered at 0.9 over 4 visits.
WINDOW, ALPHA, MASTERED_RATE, MASTERED_VISITS = 8, 0.25, 0.9, 4


def outcome(
    qid: str, attempts: int = 4, successes: int = 0, reward: float | None = None, replayed: int = 0, rescued=False
):
    mean = reward if reward is not None else (2 * successes - attempts) / max(attempts, 1)  # DAPO's +-1
    return replay_pb2.QuestionOutcome(
        question_id=qid, attempts=attempts, successes=successes, mean_reward=mean, replayed=replayed, rescued=rescued
    )


def make_pool(client, pool: str, solved: tuple[str, ...] = ()) -> None:
    """A pool (an empty add creates one) holding one success per question in `solved`."""
    client.add(pool, [Trajectory(q, f"answer of {q}", 1.0, verdict=Verdict.CORRECT) for q in solved])


def every_question(client, pool: str, **query) -> list[replay_pb2.QuestionHistory]:
    pages, cursor = [], ""
    while True:
        reply = client.question_stats(pool, cursor=cursor, **query)
        pages += reply.questions
        if not reply.next_cursor:
            return pages
        cursor = reply.next_cursor


def snapshot(client, pool: str):
    """Everything the pool says about its history (stats and every question's record)."""
    stats = client.stats(pool)
    stats.ClearField("redis_used_memory_bytes")  # the whole Redis's, which other clients change
    return stats.SerializeToString(deterministic=True), [q.SerializeToString() for q in every_question(client, pool)]


def test_a_reported_question_keeps_its_counts_window_ema_and_steps(replay_client, pool_name):
    make_pool(replay_client, pool_name, solved=("solved",))
    steps = [  # (step, version, successes of "solved", replayed into "unsolved", rescued)
        (10, 3, 1, 2, True),
        (11, 3, 0, 2, True),
        (12, 4, 4, 0, False),
    ]
    for step, version, successes, replayed, rescued in steps:
        reply = replay_client.report_outcomes(
            pool_name,
            "run-a",
            step,
            version,
            [outcome("solved", 4, successes), outcome("unsolved", 8, 0, replayed=replayed, rescued=rescued)],
        )
        assert (reply.recorded, reply.duplicate, reply.last_step) == (2, False, step)

    solved, unsolved = replay_client.question_stats(
        pool_name, question_ids=["solved", "unsolved", "never-seen"]
    ).questions
    assert solved.question_id == "solved" and unsolved.question_id == "unsolved"  # "never-seen" has no history
    assert (solved.visits, solved.attempts, solved.successes) == (3, 12, 5)
    assert solved.reward_sum == pytest.approx((2 * 1 - 4) + (0 - 4) + (8 - 4))
    assert list(solved.window_attempts) == [4, 4, 4] and list(solved.window_successes) == [1, 0, 4]
    assert solved.pass_rate == pytest.approx(5 / 12)
    ema = 0.25
    for successes in (0, 4):
        ema = ALPHA * successes / 4 + (1 - ALPHA) * ema
    assert solved.ema_pass_rate == pytest.approx(ema)
    assert (solved.first_step, solved.last_step, solved.first_policy_version, solved.last_policy_version) == (
        10,
        12,
        3,
        4,
    )
    assert solved.last_solved_step == 12 and solved.times_rescued == 0 and solved.times_replayed == 0
    # a question the pool holds no success for is kept, with what replay did to its group
    assert (unsolved.successes, unsolved.last_solved_step, unsolved.pass_rate) == (0, -1, 0.0)
    assert (unsolved.times_replayed, unsolved.replayed_rows, unsolved.times_rescued) == (2, 4, 2)

    stats = replay_client.stats(pool_name)
    assert (stats.questions_with_history, stats.rescues, stats.never_solved_questions) == (2, 2, 1)
    assert (stats.history_reports, stats.replayed_rows, stats.mastered_questions) == (3, 4, 0)
    assert {b.label: b.count for b in stats.pass_rate_histogram if b.count} == {"0.0-0.1": 1, "0.4-0.5": 1}
    assert len(stats.pass_rate_histogram) == 10
    assert (stats.history_settings.window, stats.history_settings.mastered_min_visits) == (WINDOW, MASTERED_VISITS)
    assert stats.questions == 1  # the pool's own figures are untouched


def test_the_window_keeps_the_last_visits_and_mastered_follows_it(replay_client, pool_name):
    make_pool(replay_client, pool_name)
    for step in range(1, 11):  # 2 failing visits, then 8 perfect ones: the window forgets the failures
        successes = 0 if step <= 2 else 4
        replay_client.report_outcomes(pool_name, "run", step, step, [outcome("q", 4, successes)])
        (q,) = replay_client.question_stats(pool_name, question_ids=["q"]).questions
        perfect_visits = max(0, step - 2)
        in_window = min(step, WINDOW)
        assert len(q.window_attempts) == in_window
        assert q.pass_rate == pytest.approx(min(perfect_visits, in_window) / in_window)
        expected = q.pass_rate >= MASTERED_RATE and in_window >= MASTERED_VISITS
        assert q.mastered == expected, step
        assert replay_client.stats(pool_name).mastered_questions == int(expected)
    assert q.mastered and q.pass_rate == 1.0 and q.attempts == 40 and q.successes == 32
    replay_client.report_outcomes(pool_name, "run", 11, 11, [outcome("q", 4, 0)])  # 28/32 = 0.875 < 0.9
    (q,) = replay_client.question_stats(pool_name, question_ids=["q"]).questions
    assert not q.mastered and replay_client.stats(pool_name).mastered_questions == 0
    assert every_question(replay_client, pool_name, filter=replay_pb2.MASTERED) == []


def test_pages_visit_every_question_once_by_pass_rate_and_filters_match_exactly(replay_client, pool_name):
    make_pool(replay_client, pool_name)
    rng = random.Random(7)
    truth = {}  # qid -> (successes per visit over 4 visits of 4 attempts)
    for q in range(300):
        truth[f"q{q:03d}"] = [rng.choice((0, 0, 1, 2, 4)) for _ in range(4)]
    for step in range(4):
        outcomes = [outcome(qid, 4, visits[step]) for qid, visits in truth.items()]
        assert replay_client.report_outcomes(pool_name, "run", step, 0, outcomes).recorded == 300
    rate = {qid: sum(v) / 16 for qid, v in truth.items()}

    pages = every_question(replay_client, pool_name, limit=64)
    assert [q.question_id for q in pages] == sorted(rate, key=lambda qid: (rate[qid], qid))
    first = replay_client.question_stats(pool_name, limit=64)
    assert first.matching == 300 and len(first.questions) == 64

    band = every_question(
        replay_client, pool_name, filter=replay_pb2.PASS_RATE_BAND, min_pass_rate=0.25, max_pass_rate=0.5
    )
    assert {q.question_id for q in band} == {qid for qid, r in rate.items() if 0.25 <= r <= 0.5}  # both ends included
    assert any(q.pass_rate == 0.25 for q in band) and any(q.pass_rate == 0.5 for q in band)
    never = every_question(replay_client, pool_name, filter=replay_pb2.NEVER_SOLVED, limit=7)
    assert {q.question_id for q in never} == {qid for qid, v in truth.items() if not any(v)}
    mastered = every_question(replay_client, pool_name, filter=replay_pb2.MASTERED)
    assert {q.question_id for q in mastered} == {qid for qid, r in rate.items() if r >= MASTERED_RATE}

    stats = replay_client.stats(pool_name)
    assert stats.never_solved_questions == len(never) and stats.mastered_questions == len(mastered)
    expected = [0] * 10
    for visits in truth.values():
        expected[min(10 * sum(visits) // 16, 9)] += 1
    assert [b.count for b in stats.pass_rate_histogram] == expected


def test_a_step_reported_again_is_a_duplicate_and_changes_nothing(replay_client, pool_name):
    make_pool(replay_client, pool_name)
    first = [outcome("a", 4, 1, replayed=2), outcome("b", 4, 0, replayed=2, rescued=True)]
    assert not replay_client.report_outcomes(pool_name, "run-1", 5, 1, first).duplicate
    before = snapshot(replay_client, pool_name)
    for step, outcomes in ((5, first), (5, [outcome("c", 4, 4)]), (4, first)):  # a retry, another body, an older step
        reply = replay_client.report_outcomes(pool_name, "run-1", step, 1, outcomes)
        assert (reply.recorded, reply.duplicate, reply.last_step) == (0, True, 5)
    assert snapshot(replay_client, pool_name) == before
    other = replay_client.report_outcomes(pool_name, "run-2", 5, 1, first)  # another run's step 5 counts
    assert (other.recorded, other.duplicate) == (2, False)
    assert replay_client.stats(pool_name).rescues == 2


def refused(call, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def hostile_reports(pool: str) -> dict[str, replay_pb2.ReportOutcomesRequest]:
    def request(*outcomes, **fields):
        return replay_pb2.ReportOutcomesRequest(
            **{"pool": pool, "run_id": "run", "step": 9, "policy_version": 1, "outcomes": outcomes, **fields}
        )

    nan = outcome("q", 4, 1)
    nan.mean_reward = float("nan")
    return {
        "NaN reward": request(nan),
        "infinite reward": request(outcome("q", 4, 1, reward=float("inf"))),
        "negative attempts": request(outcome("q", -4, 0)),
        "no attempt": request(outcome("q", 0, 0)),
        "negative successes": request(outcome("q", 4, -1)),
        "successes over attempts": request(outcome("q", 4, 5)),
        "negative replayed": request(outcome("q", 4, 0, replayed=-1)),
        "replayed over max_m": request(outcome("q", 4, 0, replayed=10_000)),
        "rescue of a group with a fresh success": request(outcome("q", 4, 1, replayed=2, rescued=True)),
        "empty question id": request(outcome("", 4, 1)),
        "question reported twice": request(outcome("q", 4, 1), outcome("q", 4, 1)),
        "no outcome": request(),
        "empty run id": request(outcome("q", 4, 1), run_id=""),
        "negative step": request(outcome("q", 4, 1), step=-1),
        "step past 2^53": request(outcome("q", 4, 1), step=2**60),
        "bad pool name": request(outcome("q", 4, 1), pool="a pool\n"),
    }


def test_hostile_reports_are_refused_and_change_nothing(replay_client, pool_name):
    make_pool(replay_client, pool_name)
    replay_client.report_outcomes(pool_name, "run", 1, 0, [outcome("q", 4, 2)])
    before = snapshot(replay_client, pool_name)
    for name, request in hostile_reports(pool_name).items():
        details = refused(lambda r=request: replay_client.stub.ReportOutcomes(r, timeout=10))
        assert details, name
    huge = replay_pb2.ReportOutcomesRequest(pool=pool_name, run_id="run", step=9)
    huge.outcomes.extend(outcome(f"q{i}", 4, 1) for i in range(10**6))
    started = time.monotonic()
    assert "1000000 outcomes in one report" in refused(lambda: replay_client.stub.ReportOutcomes(huge, timeout=60))
    assert time.monotonic() - started < 5  # refused on its count, before any outcome is read or stored
    assert snapshot(replay_client, pool_name) == before
    with pytest.raises(PoolNotFound):
        replay_client.report_outcomes(pool_name + "-missing", "run", 9, 0, [outcome("q", 4, 1)])
    assert pool_name + "-missing" not in replay_client.list_pools()  # a report does not create a pool


def test_hostile_question_queries_are_refused(replay_client, pool_name):
    make_pool(replay_client, pool_name)
    replay_client.report_outcomes(pool_name, "run", 1, 0, [outcome("q", 4, 2)])
    band = replay_pb2.PASS_RATE_BAND
    for query in (
        {"limit": 10**6},
        {"limit": -1},
        {"cursor": "not a cursor"},
        {"cursor": "0" * 16 + ":" + "x" * 300},
        {"filter": band, "min_pass_rate": float("nan"), "max_pass_rate": 1.0},
        {"filter": band, "min_pass_rate": 0.6, "max_pass_rate": 0.5},
        {"filter": band, "min_pass_rate": 0.0, "max_pass_rate": 1.5},
        {"filter": replay_pb2.MASTERED, "min_pass_rate": 0.5},
        {"filter": 99},
        {"question_ids": ["q"], "filter": replay_pb2.NEVER_SOLVED},
        {"question_ids": [f"q{i}" for i in range(10_000)]},
        {"question_ids": [""]},
    ):
        refused(lambda q=query: replay_client.question_stats(pool_name, **q))
    with pytest.raises(PoolNotFound):
        replay_client.question_stats(pool_name + "-missing")


def test_drop_pool_drops_its_history(replay_client, pool_name):
    make_pool(replay_client, pool_name, solved=("q",))
    replay_client.report_outcomes(pool_name, "run", 3, 0, [outcome("q", 4, 2), outcome("r", 4, 0)])
    replay_client.drop(pool_name, confirm=pool_name)
    make_pool(replay_client, pool_name)  # the same name again: a new pool, no history, and run's step 3 unknown
    stats = replay_client.stats(pool_name)
    assert (stats.questions_with_history, stats.history_reports, len(stats.pass_rate_histogram)) == (0, 0, 0)
    assert replay_client.question_stats(pool_name).questions == []
    assert replay_client.question_stats(pool_name, question_ids=["q", "r"]).questions == []
    assert not replay_client.report_outcomes(pool_name, "run", 3, 0, [outcome("q", 4, 2)]).duplicate


def test_pool_stats_questions_prints_the_history(replay, replay_client, pool_name, auth_token_file):
    from typer.testing import CliRunner

    from rlep.services.cli.app import app

    def stats_questions() -> str:
        args = ["pool", "stats", pool_name, "--questions", "-a", f"127.0.0.1:{replay.port}"]
        # rich sizes its tables to COLUMNS: wide enough that no cell wraps
        result = CliRunner().invoke(app, [*args, "--auth-token-file", str(auth_token_file)], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    make_pool(replay_client, pool_name, solved=("easy",))
    assert "no per-question history yet" in stats_questions()
    for step in range(4):
        outcomes = [outcome("easy", 4, 4), outcome("hard", 4, 0, replayed=2, rescued=True)]
        replay_client.report_outcomes(pool_name, "run", step, 0, outcomes)
    text = stats_questions()
    assert "│ questions with history │ 2 │" in text and "│ never solved by the policy │ 1 │" in text
    assert "│ rescues (replay into a group with no fresh success) │ 4 │" in text
    assert "│ 0.0-0.1 │ 1 │" in text and "│ 0.9-1.0 │ 1 │" in text  # the pass-rate distribution
    # the first page, hardest first: "hard" (never solved, rescued 4 times) before "easy" (mastered)
    assert text.index("│ hard │ 4 │ 16 │ 0 │ 0.00 │") < text.index("│ easy │ 4 │ 16 │ 16 │ 1.00 * │")
    assert "first 2 of 2" in text


def test_history_gauges_follow_each_report(replay_client, pool_name, replay, auth_token_file):
    """Issue 48's dashboard row: after a report, /metrics shows the pool's questions per pass-rate bucket, its
    mastered questions and rescues; no history series before the pool's first report."""
    from tests.metrics_util import scrape, series_value

    token = auth_token_file.read_text().strip()
    make_pool(replay_client, pool_name, solved=("a",))
    replay_client.stats(pool_name)
    assert f'rlep_replay_pool_pass_rate_questions{{bucket="0.0-0.1",pool="{pool_name}"}}' not in scrape(
        replay.metrics_port, token
    )
    rescued = outcome("b", attempts=4, successes=0, replayed=2, rescued=True)
    replay_client.report_outcomes(pool_name, "run", 1, 1, [outcome("a", 4, 4), outcome("c", 4, 2), rescued])
    text = scrape(replay.metrics_port, token)
    buckets = {
        label: series_value(text, f'rlep_replay_pool_pass_rate_questions{{bucket="{label}",pool="{pool_name}"}}')
        for label in ("0.0-0.1", "0.5-0.6", "0.9-1.0", "0.3-0.4")
    }
    assert buckets == {"0.0-0.1": 1, "0.5-0.6": 1, "0.9-1.0": 1, "0.3-0.4": 0}
    assert series_value(text, f'rlep_replay_pool_rescues{{pool="{pool_name}"}}') == 1
    assert series_value(text, f'rlep_replay_pool_mastered_questions{{pool="{pool_name}"}}') == 0  # 1 visit of 4
