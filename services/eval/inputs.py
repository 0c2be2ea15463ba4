"""What an eval job reads: datasets as questions with their prompts, and the checkpoint a job evaluates.

Prompts: built-in sets and user .jsonl files become one user message, the problem followed by
`BOXED_INSTRUCTION`; a verl parquet file's `prompt` (chat messages) is sent as it is
(`rlep.common.dataset.read_verl_parquet`, the reader training uses too). Every question is a
`rlep.common.dataset.Question`: its id hashes the prompt's content, its `data_source` is the dataset
name (a parquet row's own `data_source` for verl files).

A user file or checkpoint is named by a path on the eval server, confined to the allowed directories
(`resolve_user_path`). How the answers are counted: `accuracy`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlep.common.dataset import DatasetError, Question, chat_question, plain_answer, read_verl_parquet

BUILTIN_DIR = Path(__file__).resolve().parent / "datasets"
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CURRENT_POLICY = "current"


def chat_prompt(problem: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": f"{problem.strip()}\n\n{BOXED_INSTRUCTION}"},)


def gsm8k_answer(solution: Any) -> str:
    """GSM8K's gold is the worked solution ending in `#### 1,600`: the number after `####`, without commas."""
    text = str(solution)
    if "####" not in text:
        raise DatasetError("gsm8k answer has no '####' line")
    return text.rsplit("####", 1)[1].strip().replace(",", "")


@dataclass(frozen=True)
class BuiltinDataset:
    file: str
    problem_field: str
    read_answer: Callable[[Any], str]


BUILTIN_DATASETS: dict[str, BuiltinDataset] = {
    "aime24": BuiltinDataset("aime24.jsonl", "problem", plain_answer),
    "aime25": BuiltinDataset("aime25.jsonl", "problem", plain_answer),
    "amc23": BuiltinDataset("amc23.jsonl", "problem", plain_answer),
    "math500": BuiltinDataset("math500.jsonl", "problem", plain_answer),
    "gsm8k": BuiltinDataset("gsm8k.jsonl", "question", gsm8k_answer),
}
USER_FILE_SUFFIXES = (".jsonl", ".parquet")


def _jsonl_questions(
    path: Path,
    source: str,
    problem_fields: Sequence[str],
    read_answer: Callable[[Any], str],
    limit: int | None = None,
) -> list[Question]:
    """The first `limit` questions of a .jsonl file; reading stops there (a submission costs what it asks for)."""
    questions = []
    with path.open(encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, 1):
            if limit is not None and len(questions) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{source}: line {line_no} is not JSON ({err.msg})") from err
            problem_field = next((f for f in problem_fields if isinstance(row, dict) and f in row), None)
            if problem_field is None or "answer" not in row:
                raise DatasetError(f"{source}: line {line_no} needs '{problem_fields[0]}' and 'answer' fields")
            try:
                answer = read_answer(row["answer"])
            except DatasetError as err:
                raise DatasetError(f"{source}: line {line_no}: {err}") from err
            questions.append(chat_question(chat_prompt(str(row[problem_field])), answer, source))
    return questions


@functools.lru_cache(maxsize=len(BUILTIN_DATASETS))
def _builtin_questions(name: str) -> tuple[Question, ...]:
    spec = BUILTIN_DATASETS[name]
    return tuple(_jsonl_questions(BUILTIN_DIR / spec.file, name, (spec.problem_field,), spec.read_answer))


def resolve_user_path(text: str, allowed_roots: Iterable[Path] | None, what: str) -> Path:
    """An existing path named by a request, inside `allowed_roots` (None: anywhere; library use only).

    A path outside the roots gets the very message a missing one gets, and is refused before the file
    system is asked anything about it (the lexical check comes first), so requests cannot learn which
    files exist elsewhere on the server. The resolved path is checked again: a symlink may lead out.
    """
    unavailable = f"{what} {text!r} does not exist on the eval server under its allowed directories"
    try:
        lexical = Path(os.path.abspath(Path(text).expanduser()))
        roots = None if allowed_roots is None else _root_spellings(allowed_roots)
        if roots is not None and not any(lexical.is_relative_to(root) for root in roots):
            raise DatasetError(unavailable)
        path = lexical.resolve()
        exists = path.exists()
    except (OSError, ValueError, RuntimeError) as err:  # NUL bytes, too long, symlink loops
        if isinstance(err, DatasetError):
            raise
        raise DatasetError(f"{what} {text!r} is not a usable path ({err})") from err
    if roots is not None and not any(path.is_relative_to(root) for root in roots):
        raise DatasetError(unavailable)
    if not exists:
        raise DatasetError(unavailable)
    return path


def _root_spellings(roots: Iterable[Path]) -> set[Path]:
    """Each root as written (absolute) and with its symlinks resolved: a request may name either."""
    return {spelling for root in roots for spelling in (Path(os.path.abspath(root)), Path(root).resolve())}


def load_dataset(name: str, limit: int | None = None, allowed_roots: Iterable[Path] | None = None) -> list[Question]:
    """The first `limit` questions (all when None) of a built-in set or of a user .jsonl / .parquet file."""
    if name in BUILTIN_DATASETS:
        questions = list(_builtin_questions(name))
    elif name.endswith(USER_FILE_SUFFIXES):
        path = resolve_user_path(name, allowed_roots, "dataset file")
        if not path.is_file():
            raise DatasetError(f"dataset file {name!r} is not a file")
        if path.suffix == ".jsonl":
            questions = _jsonl_questions(path, name, ("problem", "question"), plain_answer, limit)
        else:
            questions = read_verl_parquet(path, name, limit)
    else:
        raise DatasetError(
            f"unknown dataset {name!r}: use a built-in one ({', '.join(BUILTIN_DATASETS)}) "
            "or the path of a .jsonl (problem, answer) or verl .parquet file on the eval server"
        )
    if not questions:
        raise DatasetError(f"dataset {name!r} holds no questions")
    return questions[:limit] if limit is not None else questions


def checkpoint_files(model: str, allowed_roots: Iterable[Path] | None = None) -> list[Path]:
    """The safetensors files of a checkpoint: a .safetensors file, or every one in an HF directory."""
    path = resolve_user_path(model, allowed_roots, "model")
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or any(f.suffix != ".safetensors" for f in files):
        raise DatasetError(
            f"model {model!r} is neither {CURRENT_POLICY!r} nor a checkpoint (an HF directory with *.safetensors "
            "or one .safetensors file)"
        )
    return files
