"""Answer extraction (pure string logic) and single checks on the main thread."""

import pickle
import threading
import time

import pytest
from math_verify.errors import TimeoutException

from rlep.common.answers import extract_answer
from rlep.common.types import Verdict
from rlep.services.verifier.judge import CheckOptions, check_answer, cpu_time_limit


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\left\\{1, 2\\right\\}}", "\\left\\{1, 2\\right\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$.", "5"),
        ("work...\nAnswer: 12\n", "12"),
        ("Answer: 1\nmore thought\nanswer: $\\frac{3}{4}$", "\\frac{3}{4}"),
        ("**Answer:** 9", "9"),
        ("\\boxed{12", None),
        ("no answer at all", None),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_deeply_nested_braces_extract_without_recursion():
    inner = "{" * 50_000 + "x" + "}" * 50_000
    assert extract_answer(f"\\boxed{{{inner}}}") == inner


@pytest.mark.parametrize(
    ("response", "gold", "verdict"),
    [
        ("\\boxed{\\frac{2}{4}}", "0.5", Verdict.CORRECT),
        ("\\boxed{3}", "4", Verdict.WRONG),
        ("nothing", "4", Verdict.UNPARSEABLE),
        ("\\boxed{" + "1" * 600 + "}", "1", Verdict.UNPARSEABLE),
        ("\\boxed{3}", "", Verdict.GOLD_UNPARSEABLE),
    ],
)
def test_check_answer(response, gold, verdict):
    assert check_answer(response, gold, CheckOptions(max_answer_chars=512)).verdict == verdict


def test_check_function_and_options_are_picklable():
    """Workers are spawned processes: what they are sent must pickle."""
    assert pickle.loads(pickle.dumps(check_answer)) is check_answer
    assert pickle.loads(pickle.dumps(CheckOptions(parse_timeout_s=2))).parse_timeout_s == 2


def test_cpu_time_limit_counts_cpu_time_not_wall_time():
    """A busy machine stretches wall time, not the CPU a check uses: only the latter may end it."""
    with cpu_time_limit(0.2):
        time.sleep(0.4)  # wall time passes with no CPU used: within the limit
    spun_until = None
    with pytest.raises(TimeoutException), cpu_time_limit(0.2):
        give_up = time.process_time() + 5.0
        while time.process_time() < give_up:
            pass
        spun_until = time.process_time()
    assert spun_until is None  # the limit ended the loop, not its own 5 s bound


class _SpinsWhenCollected:
    """Burns CPU in `__del__`, where Python drops any exception raised (as the limit's own would be)."""

    def __del__(self) -> None:
        give_up = time.process_time() + 2.0
        while time.process_time() < give_up:
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_limit_whose_exception_a_finaliser_dropped_still_ends_the_block_as_timeout():
    """The limit's exception lost inside the block (in a `__del__` here) must not make a cut-off parse a result."""
    finished = False
    with pytest.raises(TimeoutException), cpu_time_limit(0.05):
        _SpinsWhenCollected()  # collected at once; the limit fires inside its __del__ and is dropped there
        finished = True
    assert finished  # the block itself ran to its end: only the limit's own check can have raised


def test_check_answer_refuses_to_run_off_the_main_thread():
    """Off the main thread no CPU-time limit can be set: a loud error, not every item UNPARSEABLE."""
    outcome: list = []

    def run() -> None:
        try:
            check_answer("\\boxed{1}", "1")
        except RuntimeError as err:
            outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(outcome) == 1 and "main thread" in str(outcome[0])
