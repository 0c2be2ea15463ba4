"""Replay's request checks and pool statistics, without gRPC or Redis (the service runs them in
tests/integration/test_replay_service.py)."""

import math

import pytest

from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.pool_stats import PoolCounters, pool_stats
from rlep.services.replay.requests import (
    InvalidRequest,
    LimitExceeded,
    check_add,
    check_drop,
    check_pool_name,
    check_priority_updates,
    check_sample,
    export_chunk_questions,
    import_pool_name,
    trajectory_problem,
)
from rlep.services.replay.sampling import Strategy

CONFIG = ReplayConfig(max_m=8, max_questions_per_sample=10, max_sample_trajectories=20, max_trajectories_per_add=3)


def test_pool_names():
    check_pool_name("run-1.phase_2")
    for bad in ("a b", "base\n", "\nbase", "", "x" * 129):
        with pytest.raises(InvalidRequest, match="must match"):
            check_pool_name(bad)


@pytest.mark.parametrize(
    ("fields", "error", "phrase"),
    [
        ({"m": 0}, InvalidRequest, "m must be in 1..8, got 0"),
        ({"m": 9}, InvalidRequest, "m must be in 1..8, got 9"),
        ({"question_ids": []}, InvalidRequest, "question_ids is empty"),
        ({"question_ids": ["q"] * 11}, InvalidRequest, "11 question ids, over 10"),
        ({"question_ids": ["q", ""]}, InvalidRequest, "question_ids[1]: missing question_id"),
        ({"strategy": 99}, InvalidRequest, "unknown strategy 99"),
        ({"question_ids": ["q"] * 3, "m": 7}, LimitExceeded, "up to 21 trajectories"),
    ],
)
def test_bad_sample_requests_say_why(fields, error, phrase):
    request = replay_pb2.SampleRequest(**{"pool": "p", "question_ids": ["q"], "m": 2, **fields})
    with pytest.raises(error) as err:
        check_sample(request, CONFIG)
    assert phrase in str(err.value)


def test_a_good_sample_request_gives_its_strategy():
    request = replay_pb2.SampleRequest(pool="p", question_ids=["q"] * 10, m=2, strategy=replay_pb2.DIVERSE)
    assert check_sample(request, CONFIG) == Strategy.DIVERSE
    assert check_sample(replay_pb2.SampleRequest(pool="p", question_ids=["q"], m=1), CONFIG) == Strategy.UNIFORM


def test_add_checks_counts_questions_and_rewards():
    ok = trajectory_pb2.Trajectory(question_id="q", response_text="a", verdict=trajectory_pb2.CORRECT, reward=1.0)
    check_add("p", [ok] * 3, [replay_pb2.Question(question_id="q")], CONFIG)
    with pytest.raises(InvalidRequest, match="4 trajectories in one call, over 3"):
        check_add("p", [ok] * 4, [], CONFIG)
    with pytest.raises(InvalidRequest, match=r"questions\[0\]: missing question_id"):
        check_add("p", [], [replay_pb2.Question()], CONFIG)
    nan = trajectory_pb2.Trajectory(question_id="q", response_text="a", verdict=trajectory_pb2.CORRECT, reward=math.nan)
    with pytest.raises(InvalidRequest, match=r"trajectories\[1\].reward is nan"):
        check_add("p", [ok, nan], [], CONFIG)


def test_trajectory_problems_are_reasons_not_errors():
    def problem(**fields):
        base = {"question_id": "q", "response_text": "a", "verdict": trajectory_pb2.CORRECT}
        return trajectory_problem(trajectory_pb2.Trajectory(**{**base, **fields}), max_trajectory_bytes=1024)

    assert problem() is None
    assert problem(verdict=trajectory_pb2.WRONG) == "not a success (verdict WRONG); the pool keeps CORRECT only"
    assert problem(response_token_ids=[1, 2], behavior_logprobs=[-0.5]).endswith("differ in length")
    assert problem(response_token_ids=[1], behavior_logprobs=[math.inf]) == "behavior_logprobs must be finite"
    assert problem(response_text="x" * 2000).startswith("oversize: ")
    assert problem(tokenizer_fingerprint="f" * 65) == "tokenizer_fingerprint longer than 64 characters"


def test_a_tool_trace_is_stored_only_with_a_mask_that_fits_it():
    def problem(**fields):
        base = {
            "question_id": "q",
            "response_text": "a",
            "verdict": trajectory_pb2.CORRECT,
            "response_token_ids": [5, 6, 7],
        }
        return trajectory_problem(trajectory_pb2.Trajectory(**{**base, **fields}), max_trajectory_bytes=4096)

    call = trajectory_pb2.ToolCall(code="print(1)", status="ok", exit_code=0, stdout="1\n")
    assert problem(response_mask=[1, 0, 1], tool_calls=[call], behavior_logprobs=[-0.1, math.nan, -0.2]) is None
    assert (
        problem(response_mask=[1, 1, 1], behavior_logprobs=[-0.1, math.nan, -0.2]) == "behavior_logprobs must be finite"
    )
    assert problem(tool_calls=[call]).startswith("tool_calls without a response_mask")
    assert problem(response_mask=[1, 0]) == "response_mask and response_token_ids differ in length"
    assert problem(response_mask=[0, 0, 0]).startswith("response_mask holds 0 (tool) and 1 (policy) only")
    assert problem(response_mask=[1, 2, 1]).startswith("response_mask holds 0 (tool) and 1 (policy) only")
    assert problem(response_mask=[1, 0, 1], tool_calls=[call] * 65) == "more than 64 tool_calls"
    assert problem(tool_env_hash="e" * 65).startswith("chat_template_hash and tool_env_hash take at most 64")


def test_updates_drops_exports_and_imports():
    update = replay_pb2.PriorityUpdate(question_id="q", trajectory_id="t", priority=0.0)
    with pytest.raises(InvalidRequest, match="priority must be finite and > 0, got 0.0 for 'q'"):
        check_priority_updates(replay_pb2.UpdatePrioritiesRequest(pool="p", updates=[update]), CONFIG)
    with pytest.raises(InvalidRequest, match="confirm equal to the pool name"):
        check_drop(replay_pb2.DropPoolRequest(pool="p", confirm="yes"))
    assert export_chunk_questions(replay_pb2.ExportPoolRequest(pool="p")) == 256
    with pytest.raises(InvalidRequest, match=r"questions_per_chunk must be in 1..4096 \(0: 256\), got 5000"):
        export_chunk_questions(replay_pb2.ExportPoolRequest(pool="p", questions_per_chunk=5000))
    assert import_pool_name("", replay_pb2.PoolChunk(pool="a")) == "a"
    assert import_pool_name("a", replay_pb2.PoolChunk()) == "a"
    with pytest.raises(InvalidRequest, match="must name the same pool"):
        import_pool_name("a", replay_pb2.PoolChunk(pool="b"))


def counters(**fields) -> PoolCounters:
    empty = {
        "trajectories": 0,
        "tokens_sum": 0,
        "tokens_sq_sum": 0,
        "payload_bytes": 0,
        "capacity": 64,
        "eviction": "oldest",
        "successes_per_question": {},
        "length_buckets": {},
        "policy_versions": {},
        "redis_used_memory_bytes": 1,
    }
    return PoolCounters(**{**empty, **fields})


def test_pool_stats_figures_and_histogram_order():
    # Four trajectories of 2, 4, 4 and 20 tokens over three questions (1, 1 and 2 successes).
    stats = pool_stats(
        counters(
            trajectories=4,
            tokens_sum=30,
            tokens_sq_sum=4 + 16 + 16 + 400,
            payload_bytes=400,
            successes_per_question={2: 1, 1: 2},
            length_buckets={"16-31": 1, "2-3": 1, "4-7": 2},
            policy_versions={10: 1, 2: 3},
        )
    )
    assert (stats.questions, stats.trajectories, stats.payload_bytes) == (3, 4, 400)
    assert stats.mean_response_tokens == 7.5
    assert stats.std_response_tokens == pytest.approx(52.75**0.5)  # sqrt(436/4 - 7.5^2)
    assert stats.successes_per_question == (("1", 2), ("2", 1))
    assert stats.response_token_histogram == (("2-3", 1), ("4-7", 2), ("16-31", 1))  # by lower bound, not as text
    assert stats.per_policy_version == (("2", 3), ("10", 1))  # by version, not as text
    assert (stats.capacity_per_question, stats.eviction, stats.redis_used_memory_bytes) == (64, "oldest", 1)


def test_an_empty_pool_has_zero_mean_and_spread():
    stats = pool_stats(counters())
    assert (stats.questions, stats.mean_response_tokens, stats.std_response_tokens) == (0, 0.0, 0.0)
    # Nearly equal lengths: rounding puts sum(x^2)/n - mean^2 at -16.0 here (true variance ~0.03); the
    # spread is clamped to 0, not the square root of a negative number.
    lengths = [378_009_742] * 33 + [378_009_743]
    close = counters(trajectories=34, tokens_sum=sum(lengths), tokens_sq_sum=sum(t * t for t in lengths))
    assert pool_stats(close).std_response_tokens == 0.0
