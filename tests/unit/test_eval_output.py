"""What eval shows of a job: the `rlep eval` table, and the bounds and paging of its stored samples."""

from __future__ import annotations

import io
import json

from rich.console import Console

from rlep.common.dataset import chat_question
from rlep.common.types import FinishReason, Verdict
from rlep.services.cli.eval import results_table
from rlep.services.eval.api import (
    DatasetRequest,
    DatasetResult,
    EvalSample,
    EvaluationJob,
    EvaluationRequest,
    JobStatus,
    Progress,
    SamplePage,
)
from rlep.services.eval.samples import PageFill, clip, dataset_ranges, first_samples, page_spans, sample_records
from rlep.services.eval.store import _byte_batches
from rlep.services.rollout.types import SampleOut
from rlep.services.verifier.client import VerifyOutcome

LONG_NAME = "/mnt/shared/evaluation-sets/competition-math/2024/amc8.jsonl"


def result(name: str, truncated: int) -> DatasetResult:
    return DatasetResult(
        dataset=name,
        questions_total=20,
        questions=20,
        samples=80,
        avg_at_n=0.1,
        maj_at_n=0.2,
        pass_at_n=0.3,
        mean_response_tokens=100.0,
        correct=8,
        majority_correct=4,
        any_correct=6,
        response_tokens=8000,
        unparseable=80,
        truncated=truncated,
        verdicts={"unparseable": 80},
    )


def rendered(job: EvaluationJob, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(results_table(job))
    return console.export_text()


def test_the_table_has_a_truncated_column_and_never_cuts_a_dataset_name():
    assert len(LONG_NAME) == 60
    request = EvaluationRequest(model="current", datasets=[DatasetRequest(name=LONG_NAME)], n=4)
    job = EvaluationJob(
        id="0" * 32,
        status=JobStatus.SUCCEEDED,
        request=request,
        created_at=0.0,
        progress=Progress(),
        results=[result(LONG_NAME, 17), result("amc23", 5)],
    )
    text = rendered(job, 80)
    assert "…" not in text  # nothing is cut to fit, headers included
    assert "truncated" in text and "17/80" in text and "5/80" in text
    # The name folds onto more lines of its cell, every character kept: the cells read in order give it whole.
    cells = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert "".join(cells) == LONG_NAME + "amc23"
    assert all(len(line) <= 80 for line in text.splitlines())
    # Where the console has room, on one line as it is.
    assert LONG_NAME in rendered(job, 160)
    # Short names: all eight columns fit 80 characters with every header whole.
    short = job.model_copy(update={"results": [result("amc23", 5), result("aime24", 0)]})
    headers = next(line for line in rendered(short, 80).splitlines() if "dataset" in line)
    for header in ("questions", "avg@4", "maj@4", "pass@4", "mean tokens", "unparseable", "truncated"):
        assert header in headers


def test_a_long_text_is_cut_at_whole_characters_and_says_how_much_is_missing():
    assert clip("\\boxed{2}", 16) == "\\boxed{2}"
    assert clip("x" * 16, 16) == "x" * 16
    # é is 2 bytes: 9 of them (18 bytes) in 16 bytes keep 8 whole ones and leave 2 bytes out.
    assert clip("é" * 9, 16) == "é" * 8 + "\n[... 2 more bytes not stored]"
    assert clip("€" * 10, 16) == "€" * 5 + "\n[... 15 more bytes not stored]"  # 3 bytes each: 15 of 16 bytes used


def test_a_datasets_samples_are_ranges_of_the_stored_prefix():
    results = [{"dataset": "a", "samples": 4}, {"dataset": "b", "samples": 3}, {"dataset": "a", "samples": 5}]
    assert dataset_ranges(results, 12, "a") == [(0, 4), (7, 12)]  # a dataset requested twice: two ranges
    assert dataset_ranges(results, 12, "b") == [(4, 7)]
    assert dataset_ranges(results, 9, "a") == [(0, 4), (7, 9)]  # the store stopped at 9
    assert dataset_ranges(results, 5, "a") == [(0, 4)] and dataset_ranges(results, 5, "b") == [(4, 5)]
    assert dataset_ranges(results, 12, "c") == []
    # Pages read across the ranges, each entry once.
    ranges = [(0, 4), (7, 12)]
    assert page_spans(ranges, 0, 100) == ranges
    assert page_spans(ranges, 3, 3) == [(3, 4), (7, 9)]
    assert page_spans(ranges, 4, 2) == [(7, 9)]
    assert page_spans(ranges, 9, 5) == [] and page_spans([], 0, 5) == []
    spans = [span for offset in range(0, 9, 2) for span in page_spans(ranges, offset, 2)]
    covered = [i for start, end in spans for i in range(start, end)]
    assert covered == [0, 1, 2, 3, 7, 8, 9, 10, 11]


def records_of(question: int, prompt: str, responses: list[str]):
    samples = [SampleOut([1, 2], text, [-0.1, -0.1], FinishReason.STOP, 3) for text in responses]
    outcomes = [VerifyOutcome(0.0, Verdict.WRONG, "1", 0.01)] * len(responses)
    return sample_records("set", question, chat_question([{"role": "user", "content": prompt}], "2"), samples, outcomes)


def test_a_page_stops_before_the_sample_that_would_pass_its_byte_bound():
    # Control characters are 6 bytes each as JSON: a 16 KiB prompt is ~98 KB in every sample of a page.
    records = [records_of(q, "\x01" * 16383 + str(q), ["\\boxed{1}"] * 8) for q in range(4)]
    page = PageFill(1 << 20)
    added = [page.add(row, json.loads(row), r.question) for r in records for row in r.rows]
    count = added.index(False)
    assert 8 < count < 32 and page.full and len(page.samples) == count
    body = SamplePage(job_id="j" * 128, total=32, offset=2**53, samples=page.samples, samples_dropped=2**53,
                      next_offset=2**53, cut_at_bytes=True).model_dump_json()  # fmt: skip
    assert (1 << 20) - 100_000 < len(body.encode()) <= 1 << 20  # full up to less than one sample
    assert page.samples[9].prompt == "\x01" * 16383 + "1" and page.samples[9].sample == 1
    # The first sample always fits, however large: a page is never empty while samples remain.
    one = PageFill(1 << 20)
    huge = records_of(0, "\x01" * 16384, ["\x02" * 16384])
    big = huge.rows[0].replace("\\u0002", "\\u0002" * 12)  # a row past the bound on its own
    assert one.add(big, json.loads(big), huge.question) and not one.add(big, json.loads(big), huge.question)
    # A row stored whole (prompt included, as before prompts were kept per question) is read as it is.
    whole = EvalSample.model_validate(json.loads(huge.rows[0]) | json.loads(huge.question)).model_dump_json()
    legacy = PageFill(1 << 20)
    assert legacy.add(whole, json.loads(whole), None) and legacy.samples[0].model_dump_json() == whole


def test_rows_are_stored_without_their_prompt_and_each_batch_carries_its_questions_records():
    records = [records_of(q, f"question {q}", [f"answer {q}.{s}" for s in range(3)]) for q in range(3)]
    assert all(f"question {q}" not in row and '"prompt"' not in row for q, r in enumerate(records) for row in r.rows)
    assert json.loads(records[1].question) == {"prompt": "question 1", "ground_truth": "2", "data_source": ""}
    kept = first_samples(records, 4)
    assert [len(r.rows) for r in kept] == [3, 1]
    row_bytes = len(records[0].rows[0])
    batches = _byte_batches(records, 2 * row_bytes)  # two rows (and a question record) per call
    flat = [row for _, rows in batches for row in rows]
    assert flat == [row for r in records for row in r.rows]
    keys = [key for questions, _ in batches for key in questions[::2]]
    assert keys == [r.key for r in records]  # each question once, in the call holding its first row
    for questions, rows in batches:
        firsts = {r.key for r in records if r.rows[0] in rows}
        assert set(questions[::2]) == firsts
    assert _byte_batches([], 100) == [([], [])]
