"""The eval REST service against real rollout (tiny vLLM model), verifier and Redis.

The tiny model answers nonsense, so its figures are checked against the same seeded request scored outside
the service; figures with right answers, checked against hand-computed values, are in
tests/integration/test_eval_known_answers.py.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from safetensors.torch import save_file
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance
from typer.testing import CliRunner

from rlep.common.tiny_model import cached_model
from rlep.common.types import FinishReason
from rlep.services.cli.app import app
from rlep.services.eval.accuracy import DatasetTally, SampleScore, score_question
from rlep.services.eval.api import DatasetRequest, DatasetResult, EvaluationJob, EvaluationRequest, JobStatus
from rlep.services.eval.client import EvalApiError, EvalClient
from rlep.services.eval.config import EvalConfig
from rlep.services.eval.inputs import load_dataset
from rlep.services.eval.main import start_eval
from rlep.services.rollout.types import Sampling
from tests.metrics_util import series_value

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB_TIMEOUT_S = 240


def amc23_slice(**overrides) -> EvaluationRequest:
    fields = {"model": "current", "datasets": [DatasetRequest(name="amc23", limit=3)], "n": 2, "max_tokens": 32}
    return EvaluationRequest(**(fields | overrides))


@pytest.fixture
def arithmetic_file(tmp_path):
    """60 short questions (a user .jsonl): prompts fit the tiny model's 512 tokens with room to sample."""
    path = tmp_path / "arithmetic.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{a}+{a + 7}=?", "answer": 2 * a + 7}) + "\n" for a in range(60)))
    return path


def long_job(path, **overrides) -> EvaluationRequest:
    """Fifteen chunks of four questions: running for a few seconds, long enough to act on mid-way."""
    fields = {"model": "current", "datasets": [DatasetRequest(name=str(path))], "n": 4, "max_tokens": 96}
    return EvaluationRequest(**(fields | overrides))


def score_directly(questions, sampling, rollout_client, verifier_client) -> DatasetResult:
    """The figures of one Generate call over `questions`, verified and scored without the eval service."""
    completions = rollout_client.generate([q.chat() for q in questions], sampling)
    pairs = [(q, s) for q, c in zip(questions, completions, strict=True) for s in c.samples]
    outcomes = verifier_client.verify([(s.text, q.ground_truth) for q, s in pairs])
    scores = [
        SampleScore(o.verdict, o.extracted_answer, len(s.token_ids), s.finish_reason == FinishReason.LENGTH)
        for (_, s), o in zip(pairs, outcomes, strict=True)
    ]
    tally = DatasetTally()
    for start in range(0, len(scores), sampling.n):
        tally.add(score_question(scores[start : start + sampling.n]))
    return DatasetResult(dataset=questions[0].data_source, questions_total=len(questions), **tally.summary())


def wait_for_status(client: EvalClient, job_id: str, wanted: set[JobStatus], timeout_s: float = 60) -> EvaluationJob:
    deadline = time.monotonic() + timeout_s
    while (job := client.get(job_id)).status not in wanted:
        assert time.monotonic() < deadline, f"job {job_id} still {job.status}, wanted {wanted}"
        time.sleep(0.05)
    return job


def test_a_job_over_a_builtin_slice_returns_avg_maj_pass(
    eval_client, eval_service, auth_token_file, rollout, rollout_client, verifier_client
):
    job = eval_client.submit(amc23_slice())
    assert job.status == JobStatus.QUEUED and job.progress.questions_total == 3
    done = eval_client.wait(job.id, timeout_s=JOB_TIMEOUT_S, poll_s=0.2)
    assert done.status == JobStatus.SUCCEEDED, done.error
    assert done.progress.questions_done == 3 and done.progress.samples_done == 6
    assert done.progress.current_dataset is None
    [result] = done.results
    assert (result.dataset, result.questions, result.questions_total, result.samples) == ("amc23", 3, 3, 6)
    # The same seeded request sent straight to rollout and verifier, scored here: eval must report the same.
    sampling = Sampling(n=2, temperature=0.6, top_p=1.0, max_tokens=32, seed=0)
    expected = score_directly(load_dataset("amc23", 3), sampling, rollout_client, verifier_client)
    assert result == expected
    assert done.policy_versions == [rollout.engine.version]
    assert done.started_at >= done.created_at and done.finished_at >= done.started_at
    assert job.id in [j.id for j in eval_client.list(status=JobStatus.SUCCEEDED)]

    token = auth_token_file.read_text().strip()
    assert httpx.get(f"{eval_service.url}/metrics").status_code == 401
    text = httpx.get(f"{eval_service.url}/metrics", headers={"Authorization": f"Bearer {token}"}).text
    assert series_value(text, 'rlep_eval_questions_total{service="eval"}') == 3
    assert series_value(text, 'rlep_eval_jobs{state="succeeded"}') == 1
    assert series_value(text, 'rlep_eval_jobs{state="queued"}') == 0
    assert series_value(text, 'rlep_eval_job_seconds_count{status="succeeded"}') == 1
    assert series_value(text, 'rlep_eval_request_seconds_count{method="POST",route="/v1/evaluations",code="202"}') == 1


def test_a_checkpoint_is_pushed_to_evals_own_rollout_as_a_new_version(eval_config, eval_rollout, rollout, tmp_path):
    data = eval_config.model_dump(mode="json")
    data["allowed_roots"].append(str(cached_model("tiny")))
    data["checkpoint_rollout"] = {
        "addresses": [f"127.0.0.1:{eval_rollout.port}"],
        "auth_token_file": data["rollout"]["auth_token_file"],
        "timeout_s": 300,
    }
    config = EvalConfig.model_validate(data)
    running = start_eval(config)
    try:
        with EvalClient(running.url, token=config.server.read_auth_token()) as client:
            trained_version, before = rollout.engine.version, eval_rollout.engine.version
            job = client.wait(client.submit(amc23_slice(model=str(cached_model("tiny")))).id, timeout_s=JOB_TIMEOUT_S)
            assert job.status == JobStatus.SUCCEEDED, job.error
            assert job.policy_versions == [before + 1] == [eval_rollout.engine.version]
            assert rollout.engine.version == trained_version  # the training policy was not touched
            assert job.results[0].samples == 6

            misfit = tmp_path / "misfit.safetensors"
            save_file({"model.bogus.weight": torch.zeros(2)}, str(misfit))
            job = client.wait(client.submit(amc23_slice(model=str(misfit))).id, timeout_s=JOB_TIMEOUT_S)
            assert job.status == JobStatus.FAILED and "INVALID_ARGUMENT" in job.error and "do not fit" in job.error
            assert eval_rollout.engine.version == before + 1  # a refused push changes nothing
    finally:
        running.stop()


@pytest.mark.parametrize(
    ("body", "code", "reason"),
    [
        ({"model": "current", "datasets": [{"name": "amc24"}]}, 422, "unknown dataset 'amc24'"),
        ({"model": "current", "datasets": [{"name": "amc23"}], "n": 0}, 422, "greater than or equal to 1"),
        ({"model": "current", "datasets": [{"name": "amc23"}], "n": 9}, 422, "limit of 8 samples per question"),
        ({"model": "current", "datasets": [{"name": "amc23"}], "max_tokens": 129}, 422, "limit of 128"),
        ({"model": "current", "datasets": [{"name": "math500"}]}, 422, "at most 200 per job"),
        ({"model": "current", "datasets": []}, 422, "at least 1 item"),
        ({"model": "current", "datasets": [{"name": "amc23", "limit": 0}]}, 422, "greater than or equal to 1"),
        ({"model": "current", "datasets": [{"name": "amc23"}], "temprature": 1}, 422, "Extra inputs"),
        ({"model": "/nowhere/ckpt", "datasets": [{"name": "amc23"}]}, 422, "only model='current'"),
        ({"datasets": [{"name": "amc23"}]}, 422, "Field required"),
        ({"model": "current", "datasets": [{"name": "/nowhere/x.jsonl"}]}, 422, "does not exist on the eval server"),
    ],
)
def test_bad_submissions_get_422_with_the_reason(eval_service, auth_token_file, body, code, reason):
    headers = {"Authorization": f"Bearer {auth_token_file.read_text().strip()}"}
    body = {"max_tokens": 32} | body  # the server's limit is 128; the default (1024) would be refused first
    response = httpx.post(f"{eval_service.url}/v1/evaluations", json=body, headers=headers)
    assert response.status_code == code and reason in response.text, response.text


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("temperature", b"NaN"),
        ("temperature", b"Infinity"),
        ("top_p", b"-Infinity"),
        ("temperature", b"1e400"),
        ("model", b'"\\ud800"'),
        ("model", b'"cur\\udfffrent"'),
    ],
)
def test_json_that_is_not_strict_gets_422_not_500(eval_service, auth_token_file, field, literal):
    """Python's parser takes these; echoing them back in the reply failed (500 with a traceback) (issue 31)."""
    headers = {"Authorization": f"Bearer {auth_token_file.read_text().strip()}", "content-type": "application/json"}
    body = b'{"model": "current", "datasets": [{"name": "amc23"}], "max_tokens": 32, "%s": %s}'
    if field == "model":
        body = b'{"model": %s, "datasets": [{"name": "amc23"}], "max_tokens": 32}' % literal
    else:
        body = body % (field.encode(), literal)
    response = httpx.post(f"{eval_service.url}/v1/evaluations", content=body, headers=headers)
    assert response.status_code == 422 and "not strict JSON" in response.json()["detail"], response.text
    assert httpx.get(f"{eval_service.url}/healthz").status_code == 200


def test_auth_malformed_bodies_and_unknown_jobs(eval_service, eval_client, auth_token_file):
    url = eval_service.url
    headers = {"Authorization": f"Bearer {auth_token_file.read_text().strip()}"}
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}  # open for probes
    assert "/v1/evaluations" in httpx.get(f"{url}/openapi.json").json()["paths"]
    refusals = {
        "missing bearer token: send `Authorization: Bearer <token>`": {},
        "wrong bearer token": {"Authorization": "Bearer nope"},
        "Authorization scheme must be Bearer": {"Authorization": "Basic czNjcmV0"},
    }
    for detail, wrong in refusals.items():
        response = httpx.post(f"{url}/v1/evaluations", json=amc23_slice().model_dump(), headers=wrong)
        assert response.status_code == 401 and response.json() == {"detail": detail}
    response = httpx.post(
        f"{url}/v1/evaluations", content=b'{"model": ', headers=headers | {"content-type": "application/json"}
    )
    assert response.status_code == 422 and "JSON decode error" in response.text
    response = httpx.post(f"{url}/v1/evaluations", content=b"x" * (2 << 20), headers=headers)
    assert response.status_code == 413 and response.json()["detail"].startswith(f"request body over {1 << 20} bytes")
    with pytest.raises(EvalApiError) as err:
        eval_client.get("0" * 32)
    assert err.value.status_code == 404 and "no evaluation job" in str(err.value.detail)
    with pytest.raises(EvalApiError) as err:
        eval_client.cancel("0" * 32)
    assert err.value.status_code == 404 and err.value.detail == f"no evaluation job {'0' * 32!r}"
    response = httpx.get(f"{url}/v1/evaluations", params={"limit": 0}, headers=headers)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "limit"]
    response = httpx.get(f"{url}/v1/evaluations", params={"status": "done"}, headers=headers)
    assert response.status_code == 422 and "'queued', 'running'" in response.text


def test_cancel_a_queued_and_a_running_job(eval_client, arithmetic_file):
    running = eval_client.submit(long_job(arithmetic_file))
    queued = eval_client.submit(amc23_slice())
    wait_for_status(eval_client, running.id, {JobStatus.RUNNING})
    assert eval_client.cancel(queued.id).status == JobStatus.CANCELLED
    cancelled = eval_client.cancel(running.id)
    assert cancelled.status == JobStatus.CANCELLED and cancelled.error == "cancelled by request"
    with pytest.raises(EvalApiError) as err:
        eval_client.cancel(running.id)
    assert err.value.status_code == 409 and "already cancelled" in str(err.value.detail)
    # The worker stops at its next chunk and takes the next job; the cancelled ones stay cancelled.
    after = eval_client.wait(eval_client.submit(amc23_slice()).id, timeout_s=JOB_TIMEOUT_S)
    assert after.status == JobStatus.SUCCEEDED
    stopped = eval_client.get(running.id)
    assert stopped.status == JobStatus.CANCELLED and stopped.progress.questions_done < 60
    assert eval_client.get(queued.id).progress.questions_done == 0


def test_a_job_running_at_shutdown_is_requeued_and_finished_after_restart(eval_config, arithmetic_file):
    first = start_eval(eval_config)
    token = eval_config.server.read_auth_token()
    try:
        with EvalClient(first.url, token=token) as client:
            job = client.submit(long_job(arithmetic_file))
            wait_for_status(client, job.id, {JobStatus.RUNNING})
    finally:
        first.stop()
    second = start_eval(eval_config)  # same Redis, same key prefix
    try:
        with EvalClient(second.url, token=token) as client:
            assert client.get(job.id).status in {JobStatus.QUEUED, JobStatus.RUNNING}
            done = client.wait(job.id, timeout_s=JOB_TIMEOUT_S)
            assert done.status == JobStatus.SUCCEEDED, done.error
            assert done.progress.questions_done == 60 and done.results[0].samples == 240
            assert client.samples(job.id, limit=1).total == 240  # the first attempt's samples were dropped
    finally:
        second.stop()


def test_a_killed_service_leaves_its_job_failed_with_the_reason_and_its_queue_intact(
    eval_config, arithmetic_file, tmp_path
):
    config_file = tmp_path / "eval.yaml"
    config_file.write_text(json.dumps(eval_config.model_dump(mode="json")))  # JSON is YAML
    command = [sys.executable, "-m", "rlep.services.cli.app", "serve", "eval", "--config", str(config_file)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("eval listening on "), line
        url = line.split()[3]
        with EvalClient(url, token=eval_config.server.read_auth_token()) as client:
            interrupted = client.submit(long_job(arithmetic_file))
            waiting = client.submit(amc23_slice())
            wait_for_status(client, interrupted.id, {JobStatus.RUNNING})
    finally:
        process.kill()
        process.wait(30)
    second = start_eval(eval_config)
    try:
        with EvalClient(second.url, token=eval_config.server.read_auth_token()) as client:
            failed = wait_for_status(client, interrupted.id, {JobStatus.FAILED, JobStatus.SUCCEEDED}, timeout_s=30)
            assert failed.status == JobStatus.FAILED and "stopped without finishing" in failed.error
            assert client.wait(waiting.id, timeout_s=JOB_TIMEOUT_S).status == JobStatus.SUCCEEDED
    finally:
        second.stop()


def test_rlep_eval_command_prints_the_figures(eval_service, auth_token_file):
    args = ["eval", "--model", "current", "--datasets", "amc23:2", "--n", "2", "--max-tokens", "16"]
    args += ["--server", eval_service.url, "--auth-token-file", str(auth_token_file)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "avg@2" in result.output and "maj@2" in result.output and "pass@2" in result.output
    assert "amc23" in result.output and "2/2" in result.output
    refused = CliRunner().invoke(app, [*args[:4], "gsm8k:3", *args[5:], "--n", "99"])
    assert refused.exit_code == 2 and "limit of 8" in refused.output


# schemathesis' own pytest integration (`schemathesis.pytest.from_fixture`) needs pytest internals that
# pytest 9.2 no longer has, so each operation's strategy is run with hypothesis directly.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_errors(eval_service, auth_token_file, mode):
    headers = {"Authorization": f"Bearer {auth_token_file.read_text().strip()}"}
    schema = schemathesis.openapi.from_url(f"{eval_service.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} == {
        "GET /healthz",
        "POST /v1/evaluations",
        "GET /v1/evaluations",
        "GET /v1/evaluations/{job_id}",
        "GET /v1/evaluations/{job_id}/samples",
        "DELETE /v1/evaluations/{job_id}",
    }
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.path == "/healthz":
            continue  # takes no input: there is nothing to break

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def call(case):
            # A negative case may leave the bearer token out on purpose (the security scheme makes it required):
            # adding ours would turn it into a valid request, which the server rightly accepts. So the real
            # token replaces a generated one, and a case without one goes without.
            sent = {k.lower() for k in case.headers or {}}
            auth = headers if mode == GenerationMode.POSITIVE or "authorization" in sent else None
            # Schema-valid is not always acceptable here: a dataset name must exist and n, max_tokens must be
            # within the server's configured limits, which get 422 with the reason. Every other check runs.
            case.call_and_validate(headers=auth, excluded_checks=[positive_data_acceptance])

        call()


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (it reads whatever the server sent first), or None."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_the_rest_port_has_the_bounds_of_every_http_port(eval_service):
    """Issue 31: a 100 KB header was answered, idle and half-sent connections stayed open for ever, a Content-Length
    larger than the body hung, and ~1,100 idle connections exhausted file descriptors until /healthz failed."""
    from rlep.common.http_server import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, MAX_CONNECTIONS

    port = int(eval_service.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        reply = b""
        with contextlib.suppress(ConnectionResetError):  # the server closes with the rest of our head unread
            while chunk := sock.recv(65536):  # the status line and the body may come in separate packets
                reply += chunk
    assert reply.startswith(b"HTTP/1.0 431 Request Header Fields Too Large"), reply[:200]
    idle, half = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /healthz HTTP/1.1\r\nHost: ")
    short = socket.create_connection(("127.0.0.1", port))
    short.sendall(b'POST /v1/evaluations HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model": ')
    for sock, bound in ((idle, HEAD_TIMEOUT_S), (half, HEAD_TIMEOUT_S), (short, BODY_TIMEOUT_S)):
        waited = _closed_within(sock, bound + 5)
        sock.close()
        assert waited is not None and waited < bound + 2, (bound, waited)
    flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        answered: set[socket.socket] = set()  # refused at once (503, then closed)
        deadline = time.monotonic() + 2
        while len(answered) < 200 - MAX_CONNECTIONS and (left := deadline - time.monotonic()) > 0:
            answered.update(select.select([s for s in flood if s not in answered], [], [], left)[0])
        assert len(answered) >= 200 - MAX_CONNECTIONS  # the rest wait for their head, up to HEAD_TIMEOUT_S
    finally:
        for sock in flood:
            sock.close()
    assert httpx.get(f"{eval_service.url}/healthz", timeout=HEAD_TIMEOUT_S + 5).json() == {"status": "ok"}
