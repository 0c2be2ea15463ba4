"""Every response of an eval job, as scored: GET /v1/evaluations/{id}/samples and `rlep eval --samples FILE`.

Runs over the rollout stand-in of test_eval_known_answers.py (fixed responses per question, the real verifier
and Redis), so each sample's verdict, extracted answer and truncation is known in advance.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from typer.testing import CliRunner

from rlep.services.cli.app import app
from rlep.services.eval.api import DatasetRequest, EvaluationRequest, JobStatus
from rlep.services.eval.client import EvalApiError, EvalClient
from rlep.services.eval.config import EvalConfig
from rlep.services.eval.inputs import BOXED_INSTRUCTION
from rlep.services.eval.main import start_eval
from tests.integration import test_eval_known_answers as known

pytestmark = [pytest.mark.integration]

# The stand-in's fixtures, shared with test_eval_known_answers.py (bound here so pytest finds them).
standin, standin_config, eval_over_standin, client = (
    known.standin,
    known.standin_config,
    known.eval_over_standin,
    known.client,
)

# Per problem of known.KNOWN, per sample: (verdict, extracted answer) as the real verifier decides them.
EXPECTED = {
    "What is 1+1?": [("correct", "2"), ("correct", "2.0"), ("wrong", "3"), ("unparseable", "")],
    "Half of 1?": [("correct", "\\dfrac{1}{2}"), ("wrong", "0.4"), ("wrong", "0.4"), ("wrong", "0.3")],
    "What is 3*3?": [("wrong", "8"), ("wrong", "6"), ("wrong", "8"), ("unparseable", "")],
}


def known_file(tmp_path, name: str = "known.jsonl", problems=tuple(known.KNOWN)) -> str:
    return known.write_jsonl(tmp_path / name, [{"problem": p, "answer": known.KNOWN[p][0]} for p in problems])


def expected_samples(dataset: str, problems) -> list[dict]:
    """The records the samples endpoint must return for `problems` evaluated with n=4, in order."""
    rows = []
    for question, problem in enumerate(problems):
        gold, responses = known.KNOWN[problem]
        verdicts = EXPECTED[problem]
        for sample, ((text, tokens, reason), (verdict, answer)) in enumerate(zip(responses, verdicts, strict=True)):
            rows.append(
                {
                    "dataset": dataset,
                    "question": question,
                    "sample": sample,
                    "prompt": f"{problem}\n\n{BOXED_INSTRUCTION}",
                    "ground_truth": str(gold),
                    "data_source": dataset,  # a .jsonl's questions are labelled with the dataset's name
                    "response": text,
                    "extracted_answer": answer,
                    "verdict": verdict,
                    "score": 1.0 if verdict == "correct" else 0.0,  # math-verify's score
                    "truncated": reason == known.LENGTH,
                    "response_tokens": tokens,
                }
            )
    return rows


def run_job(client: EvalClient, *paths: str):
    request = EvaluationRequest(
        model="current", datasets=[DatasetRequest(name=p) for p in paths], n=4, temperature=0.8, max_tokens=32
    )
    job = client.wait(client.submit(request).id, timeout_s=known.WAIT_S, poll_s=0.05)
    assert job.status == JobStatus.SUCCEEDED, job.error
    return job


def test_samples_hold_every_response_with_its_verdict_answer_and_truncation(client, eval_over_standin, tmp_path,
                                                                            auth_token_file):  # fmt: skip
    first = known_file(tmp_path)
    second = known_file(tmp_path, "second.jsonl", ["Half of 1?"])
    job = run_job(client, first, second)
    expected = expected_samples(first, known.KNOWN) + expected_samples(second, ["Half of 1?"])

    page = client.samples(job.id, 0, 1000)
    assert (page.job_id, page.total, page.offset, page.samples_dropped) == (job.id, 16, 0, 0)
    assert [s.model_dump(mode="json") for s in page.samples] == expected
    # The figures and the samples agree: 2 unparseable and 1 truncated in the first dataset.
    assert job.results[0].unparseable == sum(s["verdict"] == "unparseable" for s in expected[:12]) == 2
    assert job.results[0].truncated == sum(s["truncated"] for s in expected[:12]) == 1

    # Pages of 5 cover every sample exactly once, in order; past the end is empty.
    paged = [client.samples(job.id, offset, 5) for offset in range(0, 20, 5)]
    assert [p.total for p in paged] == [16] * 4 and [len(p.samples) for p in paged] == [5, 5, 5, 1]
    assert [s for p in paged for s in p.samples] == page.samples
    assert list(client.iter_samples(job.id, page_size=3)) == page.samples
    # One dataset's samples, paged the same way.
    of_second = client.samples(job.id, 1, 2, dataset=second)
    assert (of_second.total, [s.model_dump(mode="json") for s in of_second.samples]) == (4, expected[13:15])
    assert client.samples(job.id, dataset="amc23").total == 0

    url = f"{eval_over_standin.url}/v1/evaluations/{job.id}/samples"
    headers = {"Authorization": f"Bearer {auth_token_file.read_text().strip()}"}
    assert httpx.get(url, params={"limit": 1000}, headers=headers).status_code == 200
    over = httpx.get(url, params={"limit": 1001}, headers=headers)
    assert over.status_code == 422 and over.json()["detail"][0]["loc"] == ["query", "limit"]
    assert httpx.get(url, params={"offset": -1}, headers=headers).status_code == 422
    refused = httpx.get(url)
    assert refused.status_code == 401 and "missing bearer token" in refused.json()["detail"]
    with pytest.raises(EvalApiError) as err:
        client.samples("0" * 32)
    assert err.value.status_code == 404 and err.value.detail == f"no evaluation job {'0' * 32!r}"


def test_samples_past_max_stored_samples_are_counted_not_stored(standin, standin_config, auth_token_file, tmp_path):
    running = start_eval(EvalConfig.model_validate(standin_config | {"max_stored_samples": 5}))
    try:
        with EvalClient(running.url, token=auth_token_file.read_text().strip()) as client:
            path = known_file(tmp_path)
            job = run_job(client, path)
            assert job.samples_dropped == 7 and job.results[0].samples == 12  # the figures count them all
            page = client.samples(job.id, 0, 100)
            assert (page.total, page.samples_dropped) == (5, 7)
            assert [s.model_dump(mode="json") for s in page.samples] == expected_samples(path, known.KNOWN)[:5]
    finally:
        running.stop()


def rlep_eval(service, auth_token_file, path: str, samples_file) -> list[str]:
    return [
        *("eval", "--model", "current", "--datasets", path, "--n", "4", "--temperature", "0.8", "--max-tokens", "32"),
        *("--server", service.url, "--auth-token-file", str(auth_token_file), "--samples", str(samples_file)),
    ]


def test_rlep_eval_samples_writes_every_response_as_jsonl(client, eval_over_standin, auth_token_file, tmp_path):
    path, out = known_file(tmp_path), tmp_path / "samples.jsonl"
    result = CliRunner().invoke(app, rlep_eval(eval_over_standin, auth_token_file, path, out))
    assert result.exit_code == 0, result.output
    assert f"12 samples written to {out}\n" in result.output  # the path whole on one line, whatever the width
    assert "truncated" in result.output and "1/12" in result.output  # the table's truncated column
    lines = out.read_text().splitlines()
    assert [json.loads(line) for line in lines] == expected_samples(path, known.KNOWN)

    # A job that fails part-way still leaves the samples of the chunks scored before it failed.
    failing = known.write_jsonl(
        tmp_path / "failing.jsonl",
        [{"problem": p, "answer": 1} for p in ("What is 1+1?", "Half of 1?", "not known to the stand-in")],
    )
    result = CliRunner().invoke(app, rlep_eval(eval_over_standin, auth_token_file, failing, out))
    assert result.exit_code == 1 and "failed" in result.output, result.output
    assert f"8 samples written to {out}\n" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["question"], r["sample"]) for r in rows] == [(q, s) for q in range(2) for s in range(4)]

    missing = CliRunner().invoke(app, rlep_eval(eval_over_standin, auth_token_file, path, tmp_path / "no" / "x"))
    assert missing.exit_code == 2 and "is not a directory" in re.sub(r"[\s│]+", " ", missing.output)
