"""Countdown, an example task math-verify cannot judge: reach a target with the given numbers and + - * / ( ).

Configured as a Python scorer (`function: rlep.services.verifier.countdown:score`). The scoring follows
TinyZero's countdown reward (`verl/utils/reward_score/countdown.py`): the answer is the last
`<answer>...</answer>`; each given number must be used **exactly once** (as TinyZero checks it); 1.0 when the
expression equals the target, 0.1 (format score) when there is an expression that is wrong or breaks the rules,
0.0 when there is none. Where we depart: the expression is parsed with `ast` and evaluated over exact fractions,
never with `eval`; only non-negative integer literals, binary + - * / and parentheses are allowed (no unary minus,
no decimals), and it must equal the target exactly, not within 1e-5.

The gold answer (`reward_model.ground_truth` in verl's parquet schema) is a JSON object
`{"target": int, "numbers": [int, ...]}`; `countdown_rows` generates such rows (`--data` for `rlep train`).

Not covered: answers given outside `<answer>` tags, and expressions longer than `MAX_EXPRESSION_CHARS`.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

MAX_EXPRESSION_CHARS = 256  # a handful of numbers needs a few dozen; the bound keeps ast's recursion shallow
FORMAT_SCORE = 0.1
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"^[0-9+\-*/() ]+$")
_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}


def evaluate(expression: str) -> tuple[Fraction, list[int]] | None:
    """(value, the integer literals in order) of an arithmetic expression; None if it is not one we allow.

    Allowed: non-negative integer literals, binary + - * /, parentheses. Division is exact; by zero: None.
    """
    if len(expression) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.match(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return None
    numbers: list[int] = []

    def value_of(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and (type(node.op) in _OPERATORS or isinstance(node.op, ast.Div)):
            left, right = value_of(node.left), value_of(node.right)
            if isinstance(node.op, ast.Div):
                return left / right  # ZeroDivisionError: not an allowed expression
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"{type(node).__name__} is not allowed")

    try:
        return value_of(tree.body), numbers
    except (ValueError, ZeroDivisionError):
        return None


def parse_gold(ground_truth: str) -> tuple[int, list[int]]:
    """(target, numbers) of a countdown gold answer; ValueError when it is not `{"target", "numbers"}`."""
    gold = json.loads(ground_truth)
    target, numbers = (gold.get("target"), gold.get("numbers")) if isinstance(gold, dict) else (None, None)
    if type(target) is not int or not isinstance(numbers, list) or not all(type(n) is int for n in numbers):
        raise ValueError(
            f"a countdown gold answer is {{'target': int, 'numbers': [int, ...]}}, not {ground_truth[:80]!r}"
        )
    return target, list(numbers)


def score(response: str, ground_truth: str, extra: dict | None = None) -> dict[str, Any]:
    """Countdown's reward of a response (see the module docstring): `{"score", "extracted_answer"}`.

    A malformed gold answer raises (the verifier reports ERROR): it is the data's fault, not the response's.
    """
    target, numbers = parse_gold(ground_truth)
    answers = _ANSWER.findall(response)
    if not answers:
        return {"score": 0.0, "extracted_answer": ""}
    expression = answers[-1].strip()
    evaluated = evaluate(expression)
    if evaluated is None:
        return {"score": FORMAT_SCORE, "extracted_answer": expression}
    value, used = evaluated
    correct = sorted(used) == sorted(numbers) and value == target
    return {"score": 1.0 if correct else FORMAT_SCORE, "extracted_answer": expression}


def countdown_rows(count: int, seed: int = 0, sizes: Sequence[int] = (3, 4)) -> list[dict[str, Any]]:
    """`count` solvable countdown questions as verl parquet rows (`data_source` "countdown").

    Each target is the value of a random expression over the drawn numbers (1-99), so every question has a
    solution; the prompt asks for it inside `<answer>` tags, like TinyZero's.
    """
    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        numbers = [rng.randint(1, 99) for _ in range(rng.choice(sizes))]
        expression = _random_expression(rng, numbers)
        evaluated = evaluate(expression)
        if evaluated is None or evaluated[0].denominator != 1 or not 1 <= evaluated[0] <= 999:
            continue
        target = int(evaluated[0])
        prompt = (
            f"Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
            "operations (+, -, *, /) and each number must be used exactly once. Show your work in <think> </think> "
            "tags, and return the final equation in <answer> </answer> tags, e.g. <answer> (1 + 2) / 3 </answer>."
        )
        rows.append(
            {
                "data_source": "countdown",
                "prompt": [{"role": "user", "content": prompt}],
                "reward_model": {"style": "rule", "ground_truth": json.dumps({"target": target, "numbers": numbers})},
                "extra_info": {"index": len(rows), "solution": expression},
            }
        )
    return rows


def _random_expression(rng: random.Random, numbers: list[int]) -> str:
    """A random fully parenthesised expression using each number once."""
    terms = [str(n) for n in rng.sample(numbers, len(numbers))]
    while len(terms) > 1:
        i = rng.randrange(len(terms) - 1)
        terms[i : i + 2] = [f"({terms[i]} {rng.choice('+-*/')} {terms[i + 1]})"]
    return terms[0]
