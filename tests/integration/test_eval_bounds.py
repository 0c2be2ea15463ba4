"""Eval's REST port against hostile callers (issue 46): odd methods and paths mint no metric series, and sample
pages are bounded in bytes however large the stored samples are.

Runs over the rollout stand-in of test_eval_known_answers.py (no vLLM): a job's responses are whatever the
stand-in is told to return, so a page of worst-case samples (16 KiB of control characters, 6 bytes each as JSON)
costs seconds to build.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import redis

from rlep.services.eval.api import DatasetRequest, EvaluationRequest, JobStatus
from tests.integration import test_eval_known_answers as known
from tests.metrics_util import samples, scrape

pytestmark = [pytest.mark.integration]

standin, standin_config, eval_over_standin, client = (
    known.standin,
    known.standin_config,
    known.eval_over_standin,
    known.client,
)

PAGE_BYTES = 4 << 20  # the default max_sample_page_bytes


def request_series(service, token: str) -> list:
    return [s for s in samples(scrape(service.port, token)) if s.name == "rlep_eval_request_seconds_count"]


def test_odd_methods_and_paths_mint_no_metric_series(eval_over_standin, auth_token_file):
    token = auth_token_file.read_text().strip()
    with httpx.Client(base_url=eval_over_standin.url, timeout=10) as http:
        # Unauthenticated, as the audit's: 150 distinct 1 KB methods, 150 distinct paths, both together.
        for number in range(150):
            method = f"M{number:04d}" + "X" * 1020
            assert http.request(method, "/v1/evaluations").status_code in (401, 405)
            assert http.get(f"/v1/evaluations/{number}/samples/odd-{'p' * 500}").status_code in (401, 404)
            assert http.request(method, f"/nowhere/{number}").status_code in (401, 404, 405)
        assert http.get("/healthz").status_code == 200

    series = request_series(eval_over_standin, token)
    methods = {s.labels["method"] for s in series}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"} and "other" in methods
    assert {s.labels["route"] for s in series} <= {
        "unmatched", "/healthz", "/metrics", "/v1/evaluations", "/v1/evaluations/{job_id}",
        "/v1/evaluations/{job_id}/samples",
    }  # fmt: skip
    assert len(series) <= 12, sorted((s.labels["method"][:8], s.labels["route"], s.labels["code"]) for s in series)
    # Every odd request is still counted, under "other" or its route's template.
    assert sum(s.value for s in series if s.labels["method"] == "other") == 300


QUESTIONS, N = 25, 8
# 16 KiB of control characters: 98 KB as JSON. Each question's prompt differs in its tail.
HUGE = "\x01" * (16 * 1024 - 8)


@pytest.fixture
def huge_prompt_job(standin, client, tmp_path):
    """A succeeded job of 25 questions x n=8 whose prompts are 16 KiB of control characters (short responses)."""
    problems = [f"{HUGE}#{number:05d}" for number in range(QUESTIONS)]
    for problem in problems:
        standin.answers[problem] = [("\\boxed{2}", 5, known.STOP)] * N
    path = known.write_jsonl(tmp_path / "huge.jsonl", [{"problem": p, "answer": 2} for p in problems])
    request = EvaluationRequest(
        model="current", datasets=[DatasetRequest(name=path)], n=N, temperature=0.8, max_tokens=32
    )
    job = client.wait(client.submit(request).id, timeout_s=known.WAIT_S, poll_s=0.05)
    assert job.status == JobStatus.SUCCEEDED, job.error
    return job, problems


def test_a_questions_prompt_is_stored_once_per_job(huge_prompt_job, standin_config, redis_url):
    job, _ = huge_prompt_job
    escaped = len(json.dumps(HUGE))  # the prompt as JSON, as it is stored
    store = redis.Redis.from_url(redis_url)
    keys = list(store.scan_iter(match=f"{standin_config['key_prefix']}*{job.id}", count=1000))
    stored = sum(store.memory_usage(key) or 0 for key in keys)
    # Once per question, not once per sample (8x as much).
    assert QUESTIONS * escaped < stored < 1.5 * QUESTIONS * escaped, (keys, stored)


def test_a_samples_page_is_bounded_in_bytes_and_pages_cover_every_sample(huge_prompt_job, eval_over_standin,
                                                                         auth_token_file, client):  # fmt: skip
    job, problems = huge_prompt_job
    url = f"{eval_over_standin.url}/v1/evaluations/{job.id}/samples"
    headers = {"Authorization": f"Bearer {auth_token_file.read_text().strip()}"}
    # The whole job would be 200 x 98 KB = 20 MB of JSON in one page.
    first = httpx.get(url, params={"limit": 1000}, headers=headers, timeout=30)
    assert first.status_code == 200
    body = first.json()
    assert len(first.content) <= PAGE_BYTES, len(first.content)
    count = len(body["samples"])
    assert 30 < count < QUESTIONS * N and body["total"] == QUESTIONS * N
    assert body["cut_at_bytes"] is True and body["next_offset"] == count
    # The pages, followed by next_offset, hold every sample once, in order, each with its own prompt.
    seen, offset = [], 0
    while offset is not None:
        page = client.samples(job.id, offset, 1000)
        seen += page.samples
        offset = page.next_offset
    assert [(s.question, s.sample) for s in seen] == [(q, s) for q in range(QUESTIONS) for s in range(N)]
    assert all(s.prompt.startswith(problems[s.question]) for s in seen)
    assert list(client.iter_samples(job.id)) == seen
    # A page that ends at `limit` says so too: not cut, next_offset after it; the last page has none.
    small = client.samples(job.id, 0, 3)
    assert (len(small.samples), small.cut_at_bytes, small.next_offset) == (3, False, 3)
    assert client.samples(job.id, QUESTIONS * N - 1, 1000).next_offset is None


# 16 readers of 3 pages each, in a process of their own (as real clients are: not sharing the service's GIL);
# prints the largest page's size.
READERS = """
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

url, token = sys.argv[1], sys.argv[2]

def read_pages(reader):
    largest = 0
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
        for _ in range(3):
            with http.stream("GET", url, params={"limit": 1000, "offset": reader}) as response:
                assert response.status_code == 200, response.status_code
                largest = max(largest, sum(len(chunk) for chunk in response.iter_bytes()))
    return largest

with ThreadPoolExecutor(16) as pool:
    print(max(pool.map(read_pages, range(16))))
"""


def test_health_answers_within_a_second_while_16_clients_read_big_pages(huge_prompt_job, eval_over_standin,
                                                                       auth_token_file):  # fmt: skip
    job, _ = huge_prompt_job
    url = f"{eval_over_standin.url}/v1/evaluations/{job.id}/samples"
    readers = subprocess.Popen(
        [sys.executable, "-c", READERS, url, auth_token_file.read_text().strip()], stdout=subprocess.PIPE, text=True
    )
    probes: list[float] = []
    try:
        with httpx.Client(timeout=10) as http:
            while readers.poll() is None:
                started = time.perf_counter()
                assert http.get(f"{eval_over_standin.url}/healthz").status_code == 200
                probes.append(time.perf_counter() - started)
        output, _ = readers.communicate(timeout=60)
    finally:
        readers.kill()
    assert readers.returncode == 0 and int(output) <= PAGE_BYTES, output
    assert len(probes) > 5 and max(probes) < 1.0, sorted(probes)[-5:]
