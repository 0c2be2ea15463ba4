"""Scorers beyond math (pure logic): countdown's safe evaluator and reward, the score rules, routing config."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from rlep.common.dataset import read_verl_parquet
from rlep.common.types import Verdict
from rlep.services.verifier.config import HttpScorer, MathScorer, PythonScorer, VerifierConfig
from rlep.services.verifier.countdown import countdown_rows, evaluate, score
from rlep.services.verifier.judge import CheckOptions, CheckResult, reward_of
from rlep.services.verifier.python_scorer import ScoreCall, parse_extra, run_score_call, score_of
from rlep.services.verifier.routing import score_result

GOLD = json.dumps({"target": 24, "numbers": [8, 3, 2, 1]})
HERE = "tests.unit.test_verifier_scorers"


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",  # names, calls, strings: not arithmetic
        "2**5",  # power
        "7//2",  # floor division
        "-3+5",  # unary minus
        "1.5*2",  # decimals
        "1_000",  # digit separators
        "(1",  # not an expression
        "1/0",  # division by zero
        "1+" * 200 + "1",  # longer than MAX_EXPRESSION_CHARS
        "٣+1",  # non-ASCII digits
    ],
)
def test_evaluate_refuses_all_but_integer_arithmetic(expression):
    assert evaluate(expression) is None


def test_evaluate_is_exact_and_lists_the_numbers_used():
    value, used = evaluate("(8 / 3) * 3 * (2 - 1)")
    assert value == 8 and used == [8, 3, 3, 2, 1]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>...</think><answer> (8 * 3) * (2 - 1) </answer>", 1.0),
        ("<answer>8 * 3 * 1</answer>", 0.1),  # 2 unused: every number exactly once
        ("<answer>8 * 3 * 2 / 2</answer>", 0.1),  # 2 twice, 1 unused
        ("<answer>8 + 3 + 2 + 1</answer>", 0.1),  # uses them all, wrong value
        ("<answer>(8*3)**(2-1)</answer>", 0.1),  # not allowed: format score only
        ("<answer>1</answer> then <answer>8*3*(2-1)</answer>", 1.0),  # the last answer counts
        ("8 * 3 * (2 - 1) = 24", 0.0),  # no <answer> tags
    ],
)
def test_countdown_reward_follows_tinyzero(response, expected):
    assert score(response, GOLD, {})["score"] == expected


@pytest.mark.parametrize("gold", ["24", '{"target": 24}', '{"target": "24", "numbers": [1]}', "not json"])
def test_countdown_refuses_a_malformed_gold_answer(gold):
    with pytest.raises(ValueError):
        score("<answer>1</answer>", gold, {})


def test_generated_rows_are_solvable_verl_rows(tmp_path):
    rows = countdown_rows(20, seed=3)
    assert all(
        score(f"<answer>{r['extra_info']['solution']}</answer>", r["reward_model"]["ground_truth"])["score"] == 1.0
        for r in rows
    )
    path = tmp_path / "countdown.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    questions = read_verl_parquet(path)
    assert [q.data_source for q in questions] == ["countdown"] * 20
    assert [q.ground_truth for q in questions] == [r["reward_model"]["ground_truth"] for r in rows]
    assert countdown_rows(20, seed=3) == rows  # reproducible


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, (1.0, "")), (0.25, (0.25, "")), ({"score": -2, "extracted_answer": "x"}, (-2.0, "x"))],
)
def test_score_of_takes_numbers_and_dicts(value, expected):
    assert score_of(value, max_answer_chars=512) == expected


@pytest.mark.parametrize(
    "value",
    [True, None, "1.0", math.nan, math.inf, {"score": math.nan}, {"reward": 1.0}, {"score": 1, "extracted_answer": 3}],
)
def test_score_of_refuses_anything_else(value):
    with pytest.raises(ValueError):
        score_of(value, max_answer_chars=512)


@pytest.mark.parametrize("text", ["[1]", "{", '{"a": NaN}', "3"])
def test_extra_must_be_a_json_object(text):
    with pytest.raises(ValueError):
        parse_extra(text)


def returns_nan(response: str, ground_truth: str, extra: dict) -> float:
    return math.nan


def raises(response: str, ground_truth: str, extra: dict) -> float:
    raise RuntimeError("scorer bug")


def spins(response: str, ground_truth: str, extra: dict) -> float:
    while True:
        pass


def echoes_extra(response: str, ground_truth: str, extra: dict) -> dict:
    return {"score": extra["weight"] * len(response), "extracted_answer": response}


def _call(function: str, response: str = "abc", extra: str = "", threshold: float = 1.0) -> CheckResult:
    return run_score_call(ScoreCall(function, response, "gold", extra, threshold), CheckOptions(parse_timeout_s=0.2))


def test_a_python_scorer_result_becomes_a_verdict_by_threshold():
    assert _call(f"{HERE}:echoes_extra", extra='{"weight": 0.5}', threshold=1.5).verdict == Verdict.CORRECT
    wrong = _call(f"{HERE}:echoes_extra", extra='{"weight": 0.25}', threshold=1.5)
    assert (wrong.verdict, wrong.score, wrong.extracted_answer) == (Verdict.WRONG, 0.75, "abc")


@pytest.mark.parametrize(
    ("function", "verdict"),
    [
        (f"{HERE}:returns_nan", Verdict.ERROR),
        (f"{HERE}:raises", Verdict.ERROR),
        (f"{HERE}:no_such_function", Verdict.ERROR),
        (f"{HERE}:spins", Verdict.TIMEOUT),  # CPU-time limit, as a math-verify step
    ],
)
def test_a_failing_python_scorer_is_an_error_or_timeout(function, verdict):
    result = _call(function)
    assert (result.verdict, result.score) == (verdict, None)


def test_defaults_route_everything_to_math_but_the_built_in_countdown_task():
    config = VerifierConfig(num_workers=1)
    assert config.default_scorer == MathScorer()
    assert config.scorers == {"countdown": PythonScorer(function="rlep.services.verifier.countdown:score")}
    assert VerifierConfig(num_workers=1, scorers={}).scorers == {}  # a mapping you set replaces the default one


def test_a_function_path_with_a_trailing_newline_is_refused():
    with pytest.raises(ValidationError, match="module:function"):
        PythonScorer(function="rlep.services.verifier.countdown:score\n")


def test_scorer_specs_are_checked_when_loaded():
    config = VerifierConfig.model_validate(
        {
            "num_workers": 1,
            "scorers": {
                "countdown": {"type": "python", "function": "rlep.services.verifier.countdown:score"},
                "rm": {"type": "http", "url": "http://127.0.0.1:8000/score", "success_threshold": 0.5},
            },
        }
    )
    assert isinstance(config.scorers["countdown"], PythonScorer) and isinstance(config.scorers["rm"], HttpScorer)
    for bad in (
        {"type": "python", "function": "no_colon"},
        {"type": "http", "url": "ftp://host/x"},
        {"type": "http", "url": "http://h", "retries": -1},
        {"type": "regex"},
    ):
        with pytest.raises(ValidationError):
            VerifierConfig.model_validate({"num_workers": 1, "scorers": {"x": bad}})


def test_math_rewards_are_unchanged_and_other_scores_are_rewards():
    config = VerifierConfig(num_workers=1, reward_correct=2.0, reward_wrong=-0.5)
    for verdict in Verdict:
        scored = score_result(MathScorer(), CheckResult(verdict, ""), config)
        assert scored.reward == reward_of(verdict, 2.0, -0.5)
        assert scored.score == (1.0 if verdict == Verdict.CORRECT else 0.0)
    python = PythonScorer(function="m:f", error_reward=-3.0)
    assert score_result(python, CheckResult(Verdict.WRONG, "", score=0.1), config).reward == 0.1
    assert score_result(python, CheckResult(Verdict.ERROR, ""), config).reward == -3.0


def returns_text(response: str, ground_truth: str, extra: dict) -> str:
    return "0.5"


@pytest.mark.parametrize(
    ("function", "error"),
    [
        (f"{HERE}:raises", "RuntimeError: scorer bug"),
        (f"{HERE}:returns_text", "ValueError: score must be a number, not str"),
        (f"{HERE}:returns_nan", "ValueError: score must be finite, not nan"),
        (f"{HERE}:spins", "over 0.2 s of CPU time"),
    ],
)
def test_a_failed_python_scorer_says_why_in_one_line(function, error):
    """Issue 47: the reason reaches the verifier's log (before: ERROR, reward 0, nothing said)."""
    assert _call(function).error == error


def test_scorer_failures_are_logged_first_then_at_most_once_a_minute(caplog):
    from rlep.services.verifier.routing import FAILURE_LOG_EVERY_S, FIRST_FAILURES_LOGGED, FailureLog

    now = [0.0]
    failures = FailureLog(clock=lambda: now[0])
    failed = CheckResult(Verdict.ERROR, "", error="RuntimeError: scorer bug")
    caplog.set_level("WARNING", logger="rlep.services.verifier.routing")
    for _ in range(100):
        failures.record("mine", failed)
        failures.record("mine", CheckResult(Verdict.CORRECT, "1", score=1.0))  # successes are not failures
    failures.record("other", failed)  # each scorer its own allowance
    said = [r.getMessage() for r in caplog.records]
    assert said == ["scorer mine: item ERROR: RuntimeError: scorer bug"] * FIRST_FAILURES_LOGGED + [
        "scorer other: item ERROR: RuntimeError: scorer bug"
    ]
    now[0] = FAILURE_LOG_EVERY_S
    failures.record("mine", failed)
    assert caplog.records[-1].getMessage() == (
        f"scorer mine: {101 - FIRST_FAILURES_LOGGED} more failed items (101 in all), the latest ERROR: "
        "RuntimeError: scorer bug"
    )


def test_labels_that_fall_to_the_default_scorer_are_counted():
    config = VerifierConfig(num_workers=1, scorers={"mine": {"type": "python", "function": f"{HERE}:raises"}})
    lines = config.routing_of(["mine", "mine", "", "DAPO-17k", "minee", "minee"])
    assert lines == (
        "1 questions without a data_source: scored by default_scorer (math)",
        "1 questions with data_source 'DAPO-17k': not in verifier.scorers, scored by math",
        "2 questions with data_source 'minee': not in verifier.scorers, scored by math",
    )
    assert config.routing_of(["mine"]) == ()
