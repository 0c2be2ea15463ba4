"""The demo's synthetic task: sums of a few small numbers, solved step by step, with a `\\boxed{}` answer.

A question is `23+5+17=?`; a completion adds two of the numbers, then adds the rest one at a time, and
boxes the total: `23+5=28, 28+17=45 \\boxed{45}`. Which pair comes first is free, so a question with
three terms has three valid worked solutions (`solution_paths`). That matters for experience replay:
on an answer-only task every success is the same string and replay degenerates into copying the
answer, while here the stored successes of a question differ in the route they take.

Problems are drawn from a fixed space (every tuple of `terms` numbers in [1, max_value]) that is
split once into train and eval by a hash of the sorted numbers, so the splits are disjoint even
under reordering: `5+23+17` never lands in eval when `23+5+17` is in train. Generation is
deterministic in (count, seed, split, terms, max_value) and independent of Python's hash seed.

Completions stay short, because generation and training cost scale with length: with the tiny model's
character-level tokenizer (`\\boxed{` is one token) a solution of three numbers up to 20 is at most
23 tokens plus EOS, and prompts are at most 17 tokens.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DATA_SOURCE = "rlep-arith"
EVAL_PERCENT = 10  # share of the problem space held out for evaluation
# Numbers are drawn from [1, MAX_VALUE]. With 20 (1- and 2-digit numbers, sums up to 60) the tiny model
# reaches ~20% pass@1 at T=1 after ~400 warm-up steps; with 99 it stays near 1-5% at the same budget.
MAX_VALUE = 20
TERMS = 3
Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Problem:
    question: str  # "23+5+17=?"
    answer: str  # "45", the ground truth the verifier compares against
    solution: str  # one worked solution ending in the boxed answer, e.g. "23+5=28, 28+17=45 \\boxed{45}"


def split_of(numbers: Sequence[int]) -> Split:
    """Which split a problem's numbers belong to; order-insensitive and stable across processes."""
    key = "+".join(str(n) for n in sorted(numbers)).encode()
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 100
    return "eval" if bucket < EVAL_PERCENT else "train"


def operands(problem: Problem) -> list[int]:
    """The numbers of a question, in question order."""
    return [int(n) for n in problem.question.removesuffix("=?").split("+")]


def worked_solution(numbers: Sequence[int], first_pair: tuple[int, int]) -> str:
    """The solution that adds `numbers[i] + numbers[j]` first (question order inside the pair), then the rest."""
    i, j = first_pair
    rest = [n for k, n in enumerate(numbers) if k not in (i, j)]
    total = numbers[i] + numbers[j]
    steps = [f"{numbers[i]}+{numbers[j]}={total}"]
    for n in rest:
        steps.append(f"{total}+{n}={total + n}")
        total += n
    return ", ".join(steps) + f" \\boxed{{{total}}}"


def solution_paths(problem: Problem) -> list[str]:
    """Every valid worked solution of `problem` (one per choice of the first pair), without repeats."""
    numbers = operands(problem)
    pairs = [(i, j) for i in range(len(numbers)) for j in range(i + 1, len(numbers))]
    return list(dict.fromkeys(worked_solution(numbers, pair) for pair in pairs))


def make_problem(numbers: Sequence[int]) -> Problem:
    """The problem over `numbers`; its `solution` adds left to right."""
    if len(numbers) < 2:
        raise ValueError("a problem needs at least two numbers")
    return Problem(
        question="+".join(str(n) for n in numbers) + "=?",
        answer=str(sum(numbers)),
        solution=worked_solution(numbers, (0, 1)),
    )


def make_problems(count: int, seed: int, split: Split, terms: int = TERMS, max_value: int = MAX_VALUE) -> list[Problem]:
    """`count` distinct problems of `split`, each the sum of `terms` numbers in [1, max_value].

    Deterministic in its arguments. Train and eval never share a problem, nor a reordering of one.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if terms < 2 or max_value < 1:
        raise ValueError("need terms >= 2 and max_value >= 1")
    share = EVAL_PERCENT if split == "eval" else 100 - EVAL_PERCENT
    if count > max_value**terms * share // 200:  # at most half the split: rejection sampling stays fast
        raise ValueError(f"{count} problems is too many for terms={terms}, max_value={max_value}")
    rng = random.Random(f"rlep-arith:{split}:{seed}:{terms}:{max_value}")
    chosen: dict[tuple[int, ...], Problem] = {}
    while len(chosen) < count:
        numbers = tuple(rng.randint(1, max_value) for _ in range(terms))
        if numbers not in chosen and split_of(numbers) == split:
            chosen[numbers] = make_problem(numbers)
    return list(chosen.values())


def problem_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat prompt of a problem (the tiny model's template renders it as "Q: 23+5+17=?\\nA: ")."""
    return [{"role": "user", "content": problem.question}]


def is_correct(response: str, problem: Problem) -> bool:
    """Exact integer match of the last boxed answer (what math-verify decides on this task, but fast)."""
    from rlep.common.answers import extract_answer

    answer = extract_answer(response)
    return answer is not None and answer.strip() == problem.answer


def write_parquet(problems: Sequence[Problem], path: Path | str, with_candidates: bool = False) -> Path:
    """Writes `problems` as verl/DAPO parquet: prompt, reward_model, data_source, ability, extra_info.

    `extra_info` holds the row index and the problem's split; the question id the services use is
    `rlep.common.dataset.question_id(prompt)`. `with_candidates` adds every worked solution as
    `reward_model.candidates`: RLEP's released pool format, which `rlep train` imports into its replay pool.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    candidates = [("candidates", pa.list_(pa.string()))] if with_candidates else []
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string()), *candidates])),
            ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
        ]
    )
    rows = [
        {
            "data_source": DATA_SOURCE,
            "prompt": problem_messages(p),
            "ability": "arithmetic",
            "reward_model": {"ground_truth": p.answer, "style": "rule"}
            | ({"candidates": solution_paths(p)} if with_candidates else {}),
            "extra_info": {"index": i, "split": split_of(operands(p))},
        }
        for i, p in enumerate(problems)
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path
