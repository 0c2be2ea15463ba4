"""The eval service end to end with answers known in advance, and its request checks.

A stand-in rollout deployment (a real gRPC server on loopback implementing rlep.rollout.v1) returns fixed
completions per question, the real verifier decides them, and the figures are compared with values worked
out by hand. No vLLM here, so these tests take seconds; tests/integration/test_eval_service.py runs the
same service against a real tiny model.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlep.common.tls import CA_FILE_ENV
from rlep.common.v1 import trajectory_pb2
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.eval.api import DatasetRequest, EvaluationRequest, JobStatus
from rlep.services.eval.client import EvalClient
from rlep.services.eval.config import EvalConfig
from rlep.services.eval.main import start_eval
from tests.integration.conftest import delete_keys, eval_settings
from tests.integration.test_tls import self_signed
from tests.metrics_util import samples, scrape

pytestmark = [pytest.mark.integration]

VERSION = 7
STOP, LENGTH = trajectory_pb2.STOP, trajectory_pb2.LENGTH
WAIT_S = 60  # bound on any one wait below; the jobs here take well under a second each

# Problem -> (gold answer, the 4 samples the stand-in returns: text, response tokens, finish reason).
KNOWN = {
    "What is 1+1?": (
        2,
        [("So \\boxed{2}.", 5, STOP), ("It is \\boxed{2.0}", 6, STOP), ("\\boxed{3}", 7, STOP),
         ("I cannot tell.", 8, STOP)],
    ),
    "Half of 1?": (
        "\\frac{1}{2}",
        [("\\boxed{\\dfrac{1}{2}}", 10, STOP), ("\\boxed{0.4}", 10, STOP), ("\\boxed{0.4}", 10, STOP),
         ("\\boxed{0.3}", 10, STOP)],
    ),
    "What is 3*3?": (
        9,
        [("\\boxed{8}", 3, STOP), ("\\boxed{6}", 3, STOP), ("\\boxed{8}", 3, STOP), ("so \\boxed{9", 32, LENGTH)],
    ),
}  # fmt: skip


@dataclass
class StandInRollout(rollout_pb2_grpc.RolloutServicer):
    """Answers Generate from `answers` (keyed by the problem, the prompt's text before the instruction) and
    records every call. A call holding a problem in `hold` signals `entered` and waits for `release`."""

    answers: dict[str, list[tuple[str, int, int]]]
    calls: list[tuple[list[str], rollout_pb2.SamplingOptions]] = field(default_factory=list)
    hold: set[str] = field(default_factory=set)
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def Generate(self, request, context):
        problems = [p.chat.messages[-1].content.split("\n\n")[0] for p in request.prompts]
        self.calls.append((problems, request.sampling))
        if self.hold & set(problems):
            self.entered.set()
            self.release.wait(WAIT_S)
        completions = []
        for problem in problems:
            outs = [
                rollout_pb2.Sample(
                    token_ids=list(range(tokens)),
                    text=text,
                    logprobs=[-0.5] * tokens,
                    finish_reason=reason,
                    policy_version=VERSION,
                )
                for text, tokens, reason in self.answers[problem][: request.sampling.n]
            ]
            completions.append(rollout_pb2.Completion(prompt_token_ids=[1, 2, 3], samples=outs))
        return rollout_pb2.GenerateResponse(completions=completions, policy_version=VERSION)

    def problems_generated(self) -> list[list[str]]:
        return [problems for problems, _ in self.calls]


@pytest.fixture
def standin():
    servicer = StandInRollout({problem: samples for problem, (_, samples) in KNOWN.items()})
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.address = f"127.0.0.1:{port}"
    yield servicer
    servicer.release.set()
    server.stop(0)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def standin_config(standin, verifier, redis_url, auth_token_file, tmp_path):
    """Eval over the stand-in: two questions per Generate call, user files under tmp_path, a fresh key prefix."""
    config = eval_settings(
        {"addresses": [standin.address], "timeout_s": WAIT_S},
        verifier.port,
        redis_url,
        auth_token_file,
        tmp_path,
        limits={"max_n": 8, "max_questions": 200, "max_tokens": 128, "max_job_tokens": 10_000},
        questions_per_call=2,
    )
    config["tensorboard_dir"] = str(tmp_path / "tensorboard")
    yield config
    delete_keys(redis_url, config["key_prefix"])


@pytest.fixture
def eval_over_standin(standin_config):
    running = start_eval(EvalConfig.model_validate(standin_config))
    yield running
    running.stop()


@pytest.fixture
def client(eval_over_standin, auth_token_file):
    with EvalClient(eval_over_standin.url, token=auth_token_file.read_text().strip()) as eval_client:
        yield eval_client


def test_avg_maj_pass_match_hand_computed_values(client, standin, tmp_path):
    path = write_jsonl(tmp_path / "known.jsonl", [{"problem": p, "answer": a} for p, (a, _) in KNOWN.items()])
    request = EvaluationRequest(
        model="current", datasets=[DatasetRequest(name=path)], n=4, temperature=0.8, top_p=0.95, max_tokens=32, seed=11
    )
    job = client.wait(client.submit(request).id, timeout_s=WAIT_S, poll_s=0.05)
    assert job.status == JobStatus.SUCCEEDED, job.error
    [result] = job.results
    # 1+1: right, right (2.0 votes with 2), wrong, unparseable -> majority "2" is right.
    # 1/2: right (\dfrac), 0.4, 0.4, 0.3 -> majority "0.4" is wrong, but one sample is right.
    # 3*3: 8, 6, 8, truncated "\boxed{9" (unbalanced: unparseable) -> nothing right.
    assert (result.correct, result.majority_correct, result.any_correct) == (3, 1, 2)
    assert result.avg_at_n == 3 / 12 and result.maj_at_n == 1 / 3 and result.pass_at_n == 2 / 3
    assert result.verdicts == {"correct": 3, "wrong": 7, "unparseable": 2}
    assert (result.unparseable, result.truncated, result.samples, result.questions) == (2, 1, 12, 3)
    assert result.mean_response_tokens == (5 + 6 + 7 + 8 + 4 * 10 + 3 * 3 + 32) / 12
    assert job.policy_versions == [VERSION]
    # The same figures as TensorBoard scalars of the job's own run, at the policy version sampled.
    events = EventAccumulator(str(tmp_path / "tensorboard" / job.id))
    events.Reload()
    for name, value in {"avg@4": 3 / 12, "maj@4": 1 / 3, "pass@4": 2 / 3}.items():
        [scalar] = events.Scalars(f"{path}/{name}")
        assert (scalar.step, scalar.value) == (VERSION, pytest.approx(value))
    # Two Generate calls (2 + 1 questions), each with the request's sampling options as sent.
    assert standin.problems_generated() == [list(KNOWN)[:2], list(KNOWN)[2:]]
    for _, sampling in standin.calls:
        assert (sampling.n, sampling.top_k, sampling.max_tokens, sampling.seed) == (4, 0, 32, 11)
        assert sampling.temperature == pytest.approx(0.8) and sampling.top_p == pytest.approx(0.95)


def verifier_items(verifier, token: str) -> float:
    """Responses the session's verifier has checked so far, over every verdict."""
    return sum(s.value for s in samples(scrape(verifier.metrics_port, token)) if s.name == "rlep_verifier_items_total")


def test_cancelling_a_running_job_stops_its_rollout_and_verifier_calls(
    client, standin, verifier, auth_token_file, tmp_path
):
    problems = list(KNOWN)
    rows = [{"problem": p, "answer": a} for p, (a, _) in KNOWN.items()]
    first = write_jsonl(tmp_path / "first.jsonl", [rows[0], rows[0], rows[1], rows[1], rows[2], rows[2]])
    second = write_jsonl(tmp_path / "second.jsonl", [rows[2]])
    token = auth_token_file.read_text().strip()
    items_before = verifier_items(verifier, token)
    standin.hold = {problems[1]}  # the second chunk of the first job blocks inside Generate
    job = client.submit(EvaluationRequest(model="current", datasets=[DatasetRequest(name=first)], n=2, max_tokens=32))
    assert standin.entered.wait(WAIT_S), "the second chunk never reached the rollout stand-in"
    assert client.cancel(job.id).status == JobStatus.CANCELLED
    standin.release.set()
    # One worker runs jobs in order, so once the next job is done the cancelled one has been given up.
    next_job = client.submit(
        EvaluationRequest(model="current", datasets=[DatasetRequest(name=second)], n=2, max_tokens=32)
    )
    after = client.wait(next_job.id, timeout_s=WAIT_S, poll_s=0.05)
    assert after.status == JobStatus.SUCCEEDED, after.error
    # Chunks 1 and 2 of the cancelled job reached rollout, chunk 3 never did; then the next job's one chunk.
    assert standin.problems_generated() == [[problems[0]] * 2, [problems[1]] * 2, [problems[2]]]
    # Verified: chunk 1 (2 questions x 2) and the next job (1 x 2); the chunk in flight at cancel was not.
    assert verifier_items(verifier, token) - items_before == 4 + 2
    cancelled = client.get(job.id)
    assert cancelled.status == JobStatus.CANCELLED and cancelled.progress.questions_done == 2


def file_job(path: str) -> EvaluationRequest:
    return EvaluationRequest(model="current", datasets=[DatasetRequest(name=path)], n=1, max_tokens=8)


def test_a_job_runs_only_the_questions_checked_at_submission(client, standin, tmp_path):
    """A user file that grows between submission and start does not grow the job past what was checked."""
    problems = list(KNOWN)
    rows = [{"problem": p, "answer": a} for p, (a, _) in KNOWN.items()]
    standin.hold = {problems[0]}  # the first job keeps the worker busy while the second one's file grows
    busy = client.submit(file_job(write_jsonl(tmp_path / "busy.jsonl", rows[:1])))
    assert standin.entered.wait(WAIT_S)
    growing = write_jsonl(tmp_path / "growing.jsonl", rows[1:2])
    job = client.submit(file_job(growing))
    assert job.progress.questions_total == 1
    write_jsonl(tmp_path / "growing.jsonl", rows[1:3] * 50)  # 100 questions now
    standin.release.set()
    assert client.wait(busy.id, timeout_s=WAIT_S, poll_s=0.05).status == JobStatus.SUCCEEDED
    done = client.wait(job.id, timeout_s=WAIT_S, poll_s=0.05)
    assert done.status == JobStatus.SUCCEEDED, done.error
    assert (done.progress.questions_done, done.results[0].questions, done.results[0].samples) == (1, 1, 1)
    assert standin.problems_generated() == [[problems[0]], [problems[1]]]


def post(service, body: dict, headers) -> httpx.Response:
    return httpx.post(f"{service.url}/v1/evaluations", json=body, headers=headers)


def test_one_authorization_header_with_any_case_of_bearer(eval_over_standin, standin, auth_token_file, tmp_path):
    token = auth_token_file.read_text().strip()
    path = write_jsonl(tmp_path / "q.jsonl", [{"problem": "What is 1+1?", "answer": 2}])
    body = {"model": "current", "datasets": [{"name": path}], "max_tokens": 8}
    for scheme in ("bearer", "BEARER", "Bearer"):  # RFC 7235: the scheme is case-insensitive
        response = post(eval_over_standin, body, {"Authorization": f"{scheme} {token}"})
        assert response.status_code == 202, response.text
    # Two headers are refused whichever comes first: hops disagree on which one counts.
    for pair in ([f"Bearer {token}", "Bearer nope"], ["Bearer nope", f"Bearer {token}"]):
        response = post(eval_over_standin, body, [("Authorization", value) for value in pair])
        assert response.status_code == 401 and response.json() == {
            "detail": "more than one Authorization header: send exactly one"
        }
        assert response.headers["www-authenticate"] == "Bearer"
    metrics = httpx.get(f"{eval_over_standin.url}/metrics", headers=[("Authorization", f"Bearer {token}")] * 2)
    assert metrics.status_code == 401 and "more than one" in metrics.text
    metrics = httpx.get(f"{eval_over_standin.url}/metrics", headers={"authorization": f"bearer {token}"})
    jobs = [sample.value for sample in samples(metrics.text) if sample.name == "rlep_eval_jobs"]
    assert sum(jobs) == 3  # the three submissions above, in whatever state they are now


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {"temperature": 0, "n": 4},
            "greedy sampling gives n identical samples; send n=1 or temperature > 0 (got n=4, temperature=0;",
        ),
        ({"temperature": 1e-6, "n": 2}, "(got n=2, temperature=1e-06; below 1e-05 vLLM samples greedily)"),
        ({"temperature": 2.5}, "Input should be less than or equal to 2"),
        ({"temperature": -0.1}, "Input should be greater than or equal to 0"),
        ({"top_p": 0}, "Input should be greater than 0"),
        ({"top_p": 1.01}, "Input should be less than or equal to 1"),
        ({"max_tokens": 0}, "Input should be greater than or equal to 1"),
        ({"n": 16385}, "Input should be less than or equal to 16384"),
        ({"n": 9}, "limit of 8 samples per question"),
        ({"seed": -1}, "Input should be greater than or equal to 0"),
        # 3 questions x 8 x 128 = 3072 tokens fit the 10,000 limit; x 4 datasets = 12288 do not.
        ({"n": 8, "max_tokens": 128, "copies": 4}, "= 12288 new tokens is above this server's limit of 10000 per job"),
    ],
)
def test_sampling_and_cost_are_checked_at_submission(eval_over_standin, standin, auth_token_file, tmp_path, fields,
                                                     reason):  # fmt: skip
    headers = {"Authorization": f"Bearer {auth_token_file.read_text().strip()}"}
    path = write_jsonl(tmp_path / "known.jsonl", [{"problem": p, "answer": a} for p, (a, _) in KNOWN.items()])
    fields = dict(fields)
    body = {"model": "current", "datasets": [{"name": path}] * fields.pop("copies", 1), "max_tokens": 8} | fields
    response = post(eval_over_standin, body, headers)
    assert response.status_code == 422 and reason in response.text, response.text
    assert standin.calls == []  # nothing reached the rollout deployment


def test_paths_outside_the_roots_read_like_missing_ones(eval_over_standin, auth_token_file, tmp_path, tmp_path_factory):
    headers = {"Authorization": f"Bearer {auth_token_file.read_text().strip()}"}
    outside = tmp_path_factory.mktemp("outside")
    secret = write_jsonl(outside / "secret.jsonl", [{"problem": "What is 1+1?", "answer": 2}])
    (tmp_path / "link.jsonl").symlink_to(secret)
    names = {
        "missing inside": str(tmp_path / "missing.jsonl"),
        "missing outside": str(outside / "missing.jsonl"),
        "existing outside": secret,
        "dot-dot out": f"{tmp_path}/../{outside.name}/secret.jsonl",
        "symlink out": str(tmp_path / "link.jsonl"),
    }
    answers = {}
    for case, name in names.items():
        response = post(eval_over_standin, {"model": "current", "datasets": [{"name": name}], "max_tokens": 8}, headers)
        assert response.status_code == 422, (case, response.text)
        answers[case] = response.json()["detail"].replace(repr(name), "NAME")
    assert set(answers.values()) == {
        "dataset file NAME does not exist on the eval server under its allowed directories"
    }


def test_tls_files_make_the_port_https_only(standin_config, auth_token_file, tmp_path, monkeypatch):
    cert_file, key_file = self_signed(tmp_path)
    standin_config["server"] |= {"tls_cert_file": str(cert_file), "tls_key_file": str(key_file)}
    running = start_eval(EvalConfig.model_validate(standin_config))
    try:
        assert running.url.startswith("https://127.0.0.1:")
        token = auth_token_file.read_text().strip()
        with EvalClient(running.url, token=token, tls_ca_file=cert_file) as client:
            assert client.list() == []
        monkeypatch.setenv(CA_FILE_ENV, str(cert_file))  # how `rlep eval` and the chart's pods find the CA
        with EvalClient(running.url, token=token) as client:
            assert client.list() == []
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # the TLS handshake fails: dropped
            httpx.get(running.url.replace("https://", "http://") + "/healthz")
    finally:
        running.stop()
