"""Every response of an evaluation job, kept for GET /v1/evaluations/{id}/samples and `rlep eval --samples`.

A job's figures say how many answers were unparseable or truncated; its samples say why. Each response becomes
one `EvalSample` (JSON), appended to the job's list in Redis with its chunk's progress (`JobStore.save_progress`),
in the order scored: dataset by dataset, question by question. Texts are kept whole up to `MAX_TEXT_BYTES`
(UTF-8); longer ones are cut there and end with a marker. A job keeps at most `max_stored_samples`
(EvalConfig); the rest are counted, not stored, so the stored list is always a prefix of the scored sequence and
a dataset's samples are a contiguous range of it (`dataset_ranges`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rlep.common.types import FinishReason
from rlep.services.eval.api import EvalSample

if TYPE_CHECKING:
    from rlep.common.dataset import Question
    from rlep.services.rollout.types import SampleOut
    from rlep.services.verifier.client import VerifyOutcome

MAX_TEXT_BYTES = 16 * 1024
CUT_MARKER = "\n[... {} more bytes not stored]"


def clip(text: str, limit: int = MAX_TEXT_BYTES) -> str:
    """`text` when it fits `limit` bytes of UTF-8, else its first `limit` bytes (whole characters) and a marker."""
    data = text.encode()
    if len(data) <= limit:
        return text
    kept = data[:limit].decode(errors="ignore")
    return kept + CUT_MARKER.format(len(data) - len(kept.encode()))


def sample_records(
    dataset: str, index: int, question: Question, samples: Sequence[SampleOut], outcomes: Sequence[VerifyOutcome]
) -> list[str]:
    """The JSON records of one question's responses; `index` is the question's place in `dataset`."""
    prompt, gold = clip(question.messages[-1][1]), clip(question.ground_truth)
    return [
        EvalSample(
            dataset=dataset,
            question=index,
            sample=number,
            prompt=prompt,
            ground_truth=gold,
            response=clip(sample.text),
            extracted_answer=clip(outcome.extracted_answer),
            verdict=outcome.verdict,
            truncated=sample.finish_reason == FinishReason.LENGTH,
            response_tokens=len(sample.token_ids),
        ).model_dump_json()
        for number, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True))
    ]


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
