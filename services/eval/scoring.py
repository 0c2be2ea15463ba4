"""Evaluation logic with no service around it: datasets, prompts, and the Avg@N / Maj@N / Pass@N figures.

Per question, N responses are sampled and each gets a verdict from the verifier. Over a dataset:
- Avg@N: the mean accuracy over all samples (the paper's headline metric: mean@N).
- Maj@N: the share of questions whose most frequent extracted answer is correct. Answers are grouped
  after a light normalisation (`normalize_answer`: spacing, `\\left`/`\\right`, `\\dfrac`, `27.0` -> `27`,
  ...), not by symbolic equivalence, so two equivalent spellings split their votes and Maj@N can read a
  little low. Unparseable answers do not vote; ties go to the answer seen first.
- Pass@N: the share of questions with at least one correct sample.

Prompts: built-in sets and user .jsonl files become one user message, the problem followed by
`BOXED_INSTRUCTION`; a verl parquet file's `prompt` (chat messages) is sent as it is
(`rlep.common.dataset.read_verl_parquet`, the reader training uses too). Every question is a
`rlep.common.dataset.Question`: its id hashes the prompt's content, its `data_source` is the dataset
name (a parquet row's own `data_source` for verl files).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlep.common.dataset import DatasetError, Question, chat_question, plain_answer, read_verl_parquet
from rlep.common.types import Verdict

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


# -- scoring ----------------------------------------------------------------------------------------

_VOTE_DROPPED = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$|\s+|\^\{?\\circ\}?")
_INTEGRAL_DECIMAL = re.compile(r"^(-?\d+)\.0+$")


def normalize_answer(answer: str) -> str:
    """The key answers are grouped by for the majority vote (equal keys vote together)."""
    key = _VOTE_DROPPED.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")
    return _INTEGRAL_DECIMAL.sub(r"\1", key)


def majority_answer(answers: Sequence[str]) -> str | None:
    """The most frequent normalized non-empty answer (ties: the one seen first), or None if there is none."""
    keys = [normalize_answer(a) for a in answers]
    counts = Counter(k for k in keys if k)
    return counts.most_common(1)[0][0] if counts else None


@dataclass(frozen=True)
class SampleScore:
    """One response as eval sees it: the verifier's verdict and answer, and its length."""

    verdict: Verdict
    extracted_answer: str
    response_tokens: int
    truncated: bool  # stopped by max_tokens


@dataclass(frozen=True)
class QuestionScore:
    samples: int
    correct: int
    majority_correct: bool
    response_tokens: int
    unparseable: int
    truncated: int
    verdicts: dict[str, int]


def score_question(samples: Sequence[SampleScore]) -> QuestionScore:
    """Scores one question's N samples. The voted answer is correct when the verifier judged a sample
    carrying it CORRECT (samples with the same answer share a verdict)."""
    if not samples:
        raise ValueError("a question needs at least one sample")
    voters = [s for s in samples if s.verdict != Verdict.UNPARSEABLE and s.extracted_answer]
    winner = majority_answer([s.extracted_answer for s in voters])
    majority_correct = winner is not None and any(
        s.verdict == Verdict.CORRECT for s in voters if normalize_answer(s.extracted_answer) == winner
    )
    return QuestionScore(
        samples=len(samples),
        correct=sum(s.verdict == Verdict.CORRECT for s in samples),
        majority_correct=majority_correct,
        response_tokens=sum(s.response_tokens for s in samples),
        unparseable=sum(s.verdict == Verdict.UNPARSEABLE for s in samples),
        truncated=sum(s.truncated for s in samples),
        verdicts=dict(Counter(str(s.verdict) for s in samples)),
    )


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


@dataclass
class DatasetTally:
    """Running sums over the questions of one dataset scored so far (stored with a job's progress)."""

    questions: int = 0
    samples: int = 0
    correct: int = 0
    majority_correct: int = 0
    any_correct: int = 0
    response_tokens: int = 0
    unparseable: int = 0
    truncated: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)

    def add(self, score: QuestionScore) -> None:
        self.questions += 1
        self.samples += score.samples
        self.correct += score.correct
        self.majority_correct += score.majority_correct
        self.any_correct += score.correct > 0
        self.response_tokens += score.response_tokens
        self.unparseable += score.unparseable
        self.truncated += score.truncated
        for verdict, count in score.verdicts.items():
            self.verdicts[verdict] = self.verdicts.get(verdict, 0) + count

    def summary(self) -> dict[str, Any]:
        """Avg@N, Maj@N, Pass@N and mean response length (None until a question is scored), plus the counts."""
        return {
            **asdict(self),
            "avg_at_n": _ratio(self.correct, self.samples),
            "maj_at_n": _ratio(self.majority_correct, self.questions),
            "pass_at_n": _ratio(self.any_correct, self.questions),
            "mean_response_tokens": _ratio(self.response_tokens, self.samples),
        }
