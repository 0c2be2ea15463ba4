"""The demo's arithmetic task: deterministic, correct, disjoint splits, verl parquet that the services read."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rlep.common.answers import extract_answer
from rlep.common.dataset import question_id
from rlep.services.demo.task import (
    DATA_SOURCE,
    Problem,
    is_correct,
    make_problem,
    make_problems,
    operands,
    problem_messages,
    solution_paths,
    split_of,
    write_parquet,
)


def test_same_arguments_give_the_same_problems_and_other_seeds_differ():
    assert make_problems(50, seed=3, split="train") == make_problems(50, seed=3, split="train")
    assert make_problems(50, seed=3, split="train") != make_problems(50, seed=4, split="train")
    problems = make_problems(200, seed=0, split="eval")
    assert len({p.question for p in problems}) == 200  # distinct


@pytest.mark.parametrize(("terms", "max_value"), [(3, 99), (3, 20), (2, 50), (4, 9)])
def test_answers_are_the_sums_and_every_solution_ends_in_the_boxed_answer(terms, max_value):
    for problem in make_problems(100, seed=1, split="train", terms=terms, max_value=max_value):
        numbers = operands(problem)
        assert len(numbers) == terms and all(1 <= n <= max_value for n in numbers)
        assert problem.answer == str(sum(numbers))
        assert problem.solution in solution_paths(problem)
        for solution in solution_paths(problem):
            assert solution.endswith(f"\\boxed{{{problem.answer}}}")
            assert extract_answer(solution) == problem.answer and is_correct(solution, problem)
            for step in solution.removesuffix(f" \\boxed{{{problem.answer}}}").split(", "):
                left, total = step.split("=")
                assert sum(int(n) for n in left.split("+")) == int(total)  # every step is right


def test_three_terms_have_three_paths_that_each_add_a_different_pair_first():
    problem = make_problem([23, 5, 17])
    assert problem == Problem("23+5+17=?", "45", "23+5=28, 28+17=45 \\boxed{45}")
    assert solution_paths(problem) == [
        "23+5=28, 28+17=45 \\boxed{45}",
        "23+17=40, 40+5=45 \\boxed{45}",
        "5+17=22, 22+23=45 \\boxed{45}",
    ]
    assert len(solution_paths(make_problem([7, 7, 7]))) == 1  # equal numbers: one distinct route
    assert all(len(s) <= 34 for p in make_problems(500, 0, "train") for s in solution_paths(p))  # short


def test_wrong_or_missing_answers_are_not_correct():
    problem = make_problem([23, 5, 17])
    assert not is_correct("23+5=28, 28+17=46 \\boxed{46}", problem)
    assert not is_correct("23+5=28, 28+17=45", problem)
    assert is_correct("garbage \\boxed{44} then \\boxed{45}", problem)  # the last box counts


def test_train_and_eval_never_share_a_problem_or_a_reordering_of_one():
    train = make_problems(3000, seed=0, split="train")  # the default space (3 numbers up to 20): 8,000 tuples
    held_out = make_problems(300, seed=0, split="eval")
    assert all(split_of(operands(p)) == "train" for p in train)
    assert all(split_of(operands(p)) == "eval" for p in held_out)
    assert not {tuple(sorted(operands(p))) for p in train} & {tuple(sorted(operands(p))) for p in held_out}
    assert split_of([23, 5, 17]) == split_of([17, 23, 5])


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="split"):
        make_problems(1, 0, "test")
    with pytest.raises(ValueError, match="too many"):
        make_problems(1000, 0, "eval", terms=2, max_value=9)


def test_parquet_has_the_verl_schema_and_imports_as_replay_questions(tmp_path):
    from rlep.common.pool_parquet import read_pool_rows

    problems = make_problems(20, seed=0, split="eval")
    path = write_parquet(problems, tmp_path / "data" / "eval.parquet")
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 20
    for i, (row, problem) in enumerate(zip(rows, problems, strict=True)):
        assert row["prompt"] == problem_messages(problem) == [{"role": "user", "content": problem.question}]
        assert row["reward_model"] == {"ground_truth": problem.answer, "style": "rule"}
        assert row["data_source"] == DATA_SOURCE
        assert row["extra_info"] == {"index": i, "split": "eval"}
    # A training file has no candidates: nothing in it is a pool row. With candidates, every row is one question.
    assert [q for chunk in read_pool_rows(path, pool="demo") for q in chunk.questions] == []
    pool_file = write_parquet(problems, tmp_path / "data" / "pool.parquet", with_candidates=True)
    questions = [q for chunk in read_pool_rows(pool_file, pool="demo") for q in chunk.questions]
    assert [q.question_id for q in questions] == [question_id(problem_messages(p)) for p in problems]
    assert [q.ground_truth for q in questions] == [p.answer for p in problems]


def test_parquet_with_candidates_seeds_a_pool_with_every_worked_solution(tmp_path):
    from rlep.common.pool_parquet import read_pool_rows
    from rlep.services.learner.pool_seed import has_candidates

    problems = make_problems(8, seed=1, split="train")
    plain = write_parquet(problems, tmp_path / "plain.parquet")
    seeded = write_parquet(problems, tmp_path / "seeded.parquet", with_candidates=True)
    assert not has_candidates(plain) and has_candidates(seeded)
    trajectories = [t for chunk in read_pool_rows(seeded, pool="p") for t in chunk.trajectories]
    by_question = {}
    for t in trajectories:
        by_question.setdefault(t.question_id, []).append(t.response_text)
    for problem in problems:
        texts = by_question[question_id(problem_messages(problem))]
        assert texts == solution_paths(problem) and len(texts) > 1
        assert all(is_correct(text, problem) for text in texts)


class _CountingReplay:
    """Takes an import's chunks and answers like the replay service (`rejected` rows as told)."""

    def __init__(self, rejected: int = 0):
        self.rejected = rejected

    def import_chunks(self, chunks):
        from types import SimpleNamespace

        added = sum(len(chunk.trajectories) for chunk in chunks)
        return SimpleNamespace(added=added, duplicate=0, rejected=self.rejected)


def test_seeding_a_pool_is_logged_as_information_and_rejected_rows_as_a_warning(tmp_path, caplog):
    """Seeding is the normal start of a run on such a file (INFO); only rows the pool refused are a WARNING."""
    import logging

    from rlep.services.learner.pool_seed import seed_pool_from_candidates

    seeded = write_parquet(make_problems(4, seed=1, split="train"), tmp_path / "seeded.parquet", with_candidates=True)
    with caplog.at_level(logging.INFO, logger="rlep.services.learner.pool_seed"):
        added = seed_pool_from_candidates(_CountingReplay(), "p", [seeded])
        seed_pool_from_candidates(_CountingReplay(rejected=2), "p", [seeded])
    normal, refused = [r for r in caplog.records if "seeded from seeded.parquet" in r.getMessage()]
    assert added > 0 and normal.levelno == logging.INFO and f"{added} added" in normal.getMessage()
    assert refused.levelno == logging.WARNING and "2 rejected" in refused.getMessage()
