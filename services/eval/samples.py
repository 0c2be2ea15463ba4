"""Every response of an evaluation job, kept for GET /v1/evaluations/{id}/samples and `rlep eval --samples`.

A job's figures say how many answers were unparseable or truncated; its samples say why. Each response becomes
one `EvalSample` (JSON), appended to the job's list in Redis with its chunk's progress (`JobStore.save_progress`),
in the order scored: dataset by dataset, question by question. Texts are kept whole up to `MAX_TEXT_BYTES`
(UTF-8); longer ones are cut there and end with a marker. A job keeps at most `max_stored_samples`
(EvalConfig); the rest are counted, not stored, so the stored list is always a prefix of the scored sequence and
a dataset's samples are a contiguous range of it (`dataset_ranges`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlep.common.types import FinishReason
from rlep.services.eval.api import EvalSample

if TYPE_CHECKING:
    from rlep.common.dataset import Question
    from rlep.services.rollout.types import SampleOut
    from rlep.services.verifier.client import VerifyOutcome

MAX_TEXT_BYTES = 16 * 1024
CUT_MARKER = "\n[... {} more bytes not stored]"
# Kept once per question (QuestionSamples.question), not in each sample's row.
QUESTION_FIELDS = {"prompt", "ground_truth", "data_source"}


def clip(text: str, limit: int = MAX_TEXT_BYTES) -> str:
    """`text` when it fits `limit` bytes of UTF-8, else its first `limit` bytes (whole characters) and a marker."""
    data = text.encode()
    if len(data) <= limit:
        return text
    kept = data[:limit].decode(errors="ignore")
    return kept + CUT_MARKER.format(len(data) - len(kept.encode()))


@dataclass
class QuestionSamples:
    """One question's stored responses: its prompt and gold answer are kept once per job (a hash field), not in
    each of its n samples."""

    key: str
    """The field of the job's question hash: `question_key(dataset, index)`."""
    question: str
    """`{"prompt": ..., "ground_truth": ...}` JSON."""
    rows: list[str]
    """One EvalSample JSON per response, without `prompt` and `ground_truth`."""


def question_key(dataset: str, index: int) -> str:
    return json.dumps([dataset, index])


def sample_records(
    dataset: str, index: int, question: Question, samples: Sequence[SampleOut], outcomes: Sequence[VerifyOutcome]
) -> QuestionSamples:
    """The records of one question's responses; `index` is the question's place in `dataset`."""
    prompt, gold = clip(question.messages[-1][1]), clip(question.ground_truth)
    rows = [
        EvalSample(
            dataset=dataset,
            question=index,
            sample=number,
            prompt=prompt,
            ground_truth=gold,
            data_source=clip(question.data_source),
            response=clip(sample.text),
            extracted_answer=clip(outcome.extracted_answer),
            verdict=outcome.verdict,
            score=outcome.score,
            truncated=sample.finish_reason == FinishReason.LENGTH,
            response_tokens=len(sample.token_ids),
        ).model_dump_json(exclude=QUESTION_FIELDS)
        for number, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True))
    ]
    text = EvalSample.model_construct(
        prompt=prompt, ground_truth=gold, data_source=clip(question.data_source)
    ).model_dump_json(include=QUESTION_FIELDS)
    return QuestionSamples(question_key(dataset, index), text, rows)


def first_samples(records: Iterable[QuestionSamples], count: int) -> list[QuestionSamples]:
    """The records of the first `count` responses (a question whose rows are all cut is left out)."""
    kept = []
    for record in records:
        if count <= 0:
            break
        kept.append(QuestionSamples(record.key, record.question, record.rows[:count]))
        count -= len(kept[-1].rows)
    return kept


class PageFill:
    """Samples of one page, added while they fit `max_bytes` of JSON (the first always does). A stored row holds
    the sample's JSON without its question's prompt and gold answer; the page repeats them in each sample, so
    its size counts them each time."""

    def __init__(self, max_bytes: int):
        self._budget = max_bytes - PAGE_ENVELOPE_BYTES
        self._used = 0
        self.samples: list[EvalSample] = []
        self.full = False
        self._questions: dict[str, dict] = {}  # parsed once per page: the samples share their prompt's string

    def add(self, row: str, record: dict, question: str | None) -> bool:
        """Adds one stored row (`record`: the row parsed; `question`: its question's record, None for a row that
        holds its own prompt); False, and nothing added, when the page is full."""
        size = len(row.encode()) + 1  # the comma after it
        if question is not None:
            if question not in self._questions:
                self._questions[question] = json.loads(question)
            record = record | self._questions[question]
            size += len(question.encode())  # a byte more than ',"prompt":P,"ground_truth":G' adds to the row
        if self.samples and self._used + size > self._budget:
            self.full = True
            return False
        self.samples.append(EvalSample.model_validate(record))
        self._used += size
        return True


# The page's own fields (job_id of at most 128 characters, three integers, a flag) fit in this.
PAGE_ENVELOPE_BYTES = 512


def dataset_ranges(results: Iterable[dict], stored: int, dataset: str) -> list[tuple[int, int]]:
    """The [start, end) ranges of the stored list holding `dataset`'s samples, from the job's results (samples
    scored per dataset, in order) and the list's length `stored`. A dataset requested twice has two ranges."""
    ranges, scored = [], 0
    for result in results:
        start, end = min(scored, stored), min(scored + result["samples"], stored)
        scored += result["samples"]
        if result["dataset"] == dataset and end > start:
            ranges.append((start, end))
    return ranges


def page_spans(ranges: Iterable[tuple[int, int]], offset: int, limit: int) -> list[tuple[int, int]]:
    """The [start, end) spans of the list that entries offset .. offset + limit - 1 of `ranges`, read one after
    the other, come from."""
    spans = []
    for start, end in ranges:
        if limit <= 0:
            break
        if offset >= end - start:
            offset -= end - start
            continue
        first = start + offset
        last = min(end, first + limit)
        spans.append((first, last))
        limit -= last - first
        offset = 0
    return spans
