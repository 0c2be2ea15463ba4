"""Eval's figures: the majority vote, and the Avg/Maj/Pass@N of a dataset (services/eval/accuracy.py)."""

import random
from collections import Counter

import pytest

from rlep.common.types import Verdict
from rlep.services.eval.accuracy import DatasetTally, SampleScore, majority_answer, normalize_answer, score_question


def sample(verdict: Verdict, answer: str = "", tokens: int = 10, truncated: bool = False) -> SampleScore:
    return SampleScore(verdict, answer, tokens, truncated)


@pytest.mark.parametrize(
    ("a", "b"),
    [("27", "27.0"), ("\\frac{1}{2}", "\\dfrac{1}{2}"), ("(3, \\pi)", "\\left(3,\\pi\\right)"), ("90^\\circ", "90"),
     ("5.", "5"), ("$x+1$", "x + 1")],
)  # fmt: skip
def test_spellings_that_vote_together(a, b):
    assert normalize_answer(a) == normalize_answer(b)


def test_majority_answer_counts_and_breaks_ties_by_first_seen():
    assert majority_answer(["3", "4", "4", "3.0", "3"]) == "3"
    assert majority_answer(["7", "8", "8", "7"]) == "7"
    assert majority_answer(["", " ", ""]) is None
    assert majority_answer([]) is None


def test_score_question_votes_over_parseable_answers_only():
    c, w, u = Verdict.CORRECT, Verdict.WRONG, Verdict.UNPARSEABLE
    # Three unparseable "answers" would outvote the right one if they could vote.
    score = score_question([sample(u, "\\sqrt{"), sample(u, "\\sqrt{"), sample(u, "\\sqrt{"), sample(c, "5")])
    assert score.majority_correct and score.correct == 1 and score.unparseable == 3
    score = score_question([sample(w, "4"), sample(w, "4.0"), sample(c, "5", truncated=True)])
    assert not score.majority_correct and score.correct == 1 and score.truncated == 1
    assert score.verdicts == {"wrong": 2, "correct": 1} and score.response_tokens == 30
    assert not score_question([sample(u), sample(u)]).majority_correct
    with pytest.raises(ValueError):
        score_question([])


def test_tally_figures_and_their_bounds():
    tally = DatasetTally()
    assert tally.summary()["avg_at_n"] is None and tally.summary()["pass_at_n"] is None
    c, w = Verdict.CORRECT, Verdict.WRONG
    tally.add(score_question([sample(c, "1"), sample(c, "1"), sample(w, "2"), sample(w, "3")]))  # maj right
    tally.add(score_question([sample(c, "1"), sample(w, "2"), sample(w, "2"), sample(w, "2")]))  # maj wrong
    tally.add(score_question([sample(w, "2", tokens=30)] * 4))  # nothing right
    summary = tally.summary()
    assert summary["avg_at_n"] == 3 / 12 and summary["maj_at_n"] == 1 / 3 and summary["pass_at_n"] == 2 / 3
    assert summary["mean_response_tokens"] == (8 * 10 + 4 * 30) / 12 and summary["samples"] == 12
    rng = random.Random(0)
    for _ in range(200):
        tally, n = DatasetTally(), rng.randint(1, 6)  # one n per job, as the service samples
        questions = [
            [(rng.choice(list(Verdict)), rng.choice(["1", "2", ""])) for _ in range(n)]
            for _ in range(rng.randint(1, 5))
        ]
        for drawn in questions:
            tally.add(score_question([sample(verdict, answer) for verdict, answer in drawn]))
        s = tally.summary()
        # The same figures counted directly from the draws.
        correct = [[v == Verdict.CORRECT for v, _ in drawn] for drawn in questions]
        assert s["avg_at_n"] == sum(map(sum, correct)) / (n * len(questions))
        assert s["pass_at_n"] == sum(map(any, correct)) / len(questions)
        assert s["maj_at_n"] == sum(map(_majority_is_right, questions)) / len(questions)
        assert s["verdicts"] == dict(Counter(str(v) for drawn in questions for v, _ in drawn))


def _majority_is_right(drawn: list[tuple[Verdict, str]]) -> bool:
    """Independent majority rule for the draws above ("1", "2" or no answer): the most frequent answer among
    parseable samples (ties: seen first) is right when a sample carrying it was judged correct."""
    votes = [(v, a) for v, a in drawn if v != Verdict.UNPARSEABLE and a]
    if not votes:
        return False
    answers = [a for _, a in votes]
    winner = max(dict.fromkeys(answers), key=answers.count)  # dict keeps first-seen order; max keeps the first tie
    return any(v == Verdict.CORRECT for v, a in votes if a == winner)
