"""The eval REST API (FastAPI): submit, read, list and cancel jobs, read their samples; /metrics and /healthz on
the same app.

A thin adapter: requests are checked here (limits, datasets, checkpoint paths) so bad input gets a 4xx
with the reason before anything is queued; jobs live in `JobStore` and run in `JobRunner`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Annotated

import redis
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from rlep.common.auth import check_bearer
from rlep.common.strict_json import strict_json_problem
from rlep.services.eval.api import (
    ErrorBody,
    EvaluationJob,
    EvaluationRequest,
    JobList,
    JobStatus,
    Progress,
    SamplePage,
)
from rlep.services.eval.config import EvalConfig
from rlep.services.eval.inputs import CURRENT_POLICY, DatasetError, checkpoint_files, load_dataset
from rlep.services.eval.store import JobStore


class EvalMetrics:
    """The eval service's Prometheus series (`rlep_eval_*`)."""

    def __init__(self, registry: CollectorRegistry, store: JobStore):
        self.jobs = Gauge(
            "rlep_eval_jobs",
            "Evaluation jobs by state (every replica's: read from Redis)",
            ["state"],
            registry=registry,
        )
        for status in JobStatus:
            self.jobs.labels(status.value).set_function(lambda s=status: _count_or_nan(store, s))
        self.questions = Counter(
            "rlep_eval_questions_total", "Questions sampled and scored by this replica", registry=registry
        )
        self.request_seconds = Histogram(
            "rlep_eval_request_seconds",
            "Latency of an HTTP request, by method, route template and status code",
            ["method", "route", "code"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.job_seconds = Histogram(
            "rlep_eval_job_seconds",
            "Wall time of the jobs this replica ran, by final status",
            ["status"],
            registry=registry,
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400),
        )

    def observe_request(self, request: Request, code: int, seconds: float) -> None:
        """Records one request's latency. Label values come from closed sets only: the request is not yet
        authenticated, and a label per odd method or path would let any caller mint series without bound."""
        method = request.method if request.method in LABELLED_METHODS else "other"
        route = request.scope.get("route")  # the template (/v1/evaluations/{job_id}), one of the app's own
        self.request_seconds.labels(method, getattr(route, "path", "unmatched"), str(code)).observe(seconds)


# The methods an HTTP client sends in practice; any other method is counted as "other".
LABELLED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _count_or_nan(store: JobStore, status: JobStatus) -> float:
    try:
        return float(store.count(status))
    except redis.RedisError:  # a scrape must not fail because Redis is away; NaN shows the gap
        return math.nan


def validate_request(request: EvaluationRequest, config: EvalConfig) -> Progress:
    """Checks a submission against the limits and loads its datasets (DatasetError / ValueError say what is
    wrong). Returns the job's initial progress, which holds its number of questions."""
    limits = config.limits
    if request.n > limits.max_n:
        raise ValueError(f"n={request.n} is above this server's limit of {limits.max_n} samples per question")
    if request.max_tokens > limits.max_tokens:
        raise ValueError(f"max_tokens={request.max_tokens} is above this server's limit of {limits.max_tokens}")
    if len(request.datasets) > limits.max_datasets:
        raise ValueError(f"{len(request.datasets)} datasets: this server takes at most {limits.max_datasets}")
    if request.model != CURRENT_POLICY:
        if config.checkpoint_rollout is None:
            raise ValueError(
                f"this eval service evaluates only model={CURRENT_POLICY!r}: it has no checkpoint_rollout (a rollout "
                "replica of its own that checkpoints are pushed to; docs/eval.md); or evaluate the checkpoint "
                "without an eval service: rlep eval --local --model PATH"
            )
        checkpoint_files(request.model, config.allowed_roots)
    total = 0
    for dataset in request.datasets:
        # Reading stops one question past the limit: a huge file costs no more than a refusal needs.
        budget = limits.max_questions - total + 1
        total += len(load_dataset(dataset.name, min(dataset.limit or budget, budget), config.allowed_roots))
        if total > limits.max_questions:
            raise ValueError(
                f"over {limits.max_questions} questions: this server takes at most {limits.max_questions} per job"
            )
    if total * request.n > limits.max_samples:
        raise ValueError(f"{total} questions x n={request.n} is above this server's limit of {limits.max_samples}")
    tokens = total * request.n * request.max_tokens
    if tokens > limits.max_job_tokens:
        raise ValueError(
            f"{total} questions x n={request.n} x max_tokens={request.max_tokens} = {tokens} new tokens is above this "
            f"server's limit of {limits.max_job_tokens} per job (limits.max_job_tokens): ask for fewer"
        )
    return Progress(questions_total=total)


# Module level: FastAPI resolves the (postponed) annotations of the route functions in this module's namespace.
JobId = Annotated[str, Path(min_length=1, max_length=128, description="The id returned on submission.")]


class ListQuery(BaseModel):
    """Query of GET /v1/evaluations; unknown parameters are refused (422), as unknown body fields are."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    limit: int = Field(50, ge=1, le=1000)
    """Newest jobs to return."""
    status: JobStatus | None = None
    """Only jobs in this state."""


MAX_SAMPLES_PAGE = 1000
# Sample pages being built at once; more readers wait their turn (each holds one of the HTTP server's threads).
CONCURRENT_SAMPLE_PAGES = 4


class SamplesQuery(BaseModel):
    """Query of GET /v1/evaluations/{id}/samples; unknown parameters are refused (422)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    offset: int = Field(0, ge=0, le=2**53)
    """Samples to skip (of those matching `dataset`)."""
    limit: int = Field(100, ge=1, le=MAX_SAMPLES_PAGE)
    """Samples to return."""
    # Bounded well below a dataset name's 4096: percent-encoded, the query must fit the 16 KiB request head.
    dataset: str | None = Field(None, min_length=1, max_length=512)
    """Only this dataset's samples (its name as requested)."""


BEARER = HTTPBearer(auto_error=False, description="The token in the service's auth_token_file.")


class TokenCheck:
    """A route dependency: 401 unless the request carries exactly one `Authorization: Bearer <token>` header
    (the rule every RLEP transport shares: rlep.common.auth)."""

    def __init__(self, token: str):
        self._expected = token

    def __call__(self, request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        # BEARER only documents the scheme in the OpenAPI schema: it reads one header and would hide a second.
        refused = check_bearer(request.headers.getlist("authorization"), self._expected)
        if refused is not None:
            raise HTTPException(401, refused, headers={"WWW-Authenticate": "Bearer"})


def _errors(*codes: int) -> dict:
    responses: dict = {code: {"model": ErrorBody} for code in codes}
    if 400 in responses:  # the HTTP server refuses malformed HTTP itself, before the app sees it
        responses[400]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return responses


def create_app(
    config: EvalConfig,
    store: JobStore,
    metrics: EvalMetrics,
    registry: CollectorRegistry,
    wake: Callable[[], None],
    failure: Callable[[], str | None] = lambda: None,
) -> FastAPI:
    """The ASGI app. `wake` tells this replica's runner that a job was queued; `failure()` names what broke the
    service for good (its embedded Redis lost), which /healthz then answers with 503."""
    token = config.server.read_auth_token()
    guarded = [Depends(TokenCheck(token))] if token else []
    app = FastAPI(
        title="RLEP evaluation service",
        version="1",
        description="Evaluation jobs (Avg@N, Maj@N, Pass@N on math sets) run through the rollout and verifier "
        "services; jobs and results are kept in Redis.",
    )
    _add_service_routes(app, config, metrics, registry, guarded, failure)
    app.include_router(job_routes(config, store, wake, guarded))
    return app


def _add_service_routes(
    app: FastAPI,
    config: EvalConfig,
    metrics: EvalMetrics,
    registry: CollectorRegistry,
    guarded: list,
    failure: Callable[[], str | None],
) -> None:
    """Request size bound, latency metric, Redis outages as 503, /healthz and /metrics."""

    @app.middleware("http")
    async def measure_and_bound(request: Request, call_next):
        started = time.perf_counter()
        length = request.headers.get("content-length") or None  # a WSGI bridge passes "" for no body
        if length is not None and (not length.isdigit() or int(length) > config.server.max_request_bytes):
            response = JSONResponse(
                {"detail": f"request body over {config.server.max_request_bytes} bytes (or a bad Content-Length)"},
                status_code=413,
            )
        elif length is None and "transfer-encoding" in request.headers:
            response = JSONResponse({"detail": "send the body with a Content-Length"}, status_code=411)
        elif length not in (None, "0") and (problem := strict_json_problem(await request.body())):
            # NaN, Infinity, 1e400 or a lone surrogate parse in Python but cannot be echoed back: refused first.
            response = JSONResponse({"detail": problem}, status_code=422)
        else:
            response = await call_next(request)
        metrics.observe_request(request, response.status_code, time.perf_counter() - started)
        return response

    @app.exception_handler(redis.RedisError)
    async def redis_unavailable(request: Request, err: redis.RedisError) -> JSONResponse:
        return JSONResponse({"detail": f"job store (Redis) unavailable: {err}"}, status_code=503)

    @app.get("/healthz", tags=["service"])
    def healthz() -> JSONResponse:
        """Liveness (open, for probes): 503 once the service cannot work again without a restart."""
        if reason := failure():
            return JSONResponse({"status": "failing", "detail": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", include_in_schema=False, dependencies=guarded)
    def prometheus_metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def job_routes(config: EvalConfig, store: JobStore, wake: Callable[[], None], guarded: list) -> APIRouter:
    """/v1/evaluations: submit, list, read, cancel, samples."""
    router = APIRouter(
        prefix="/v1/evaluations",
        tags=["evaluations"],
        dependencies=guarded,
        # 400 on any route: a malformed HTTP request (e.g. a bad Content-Length header).
        responses=_errors(400, *((401,) if guarded else ()), 422, 503),
    )

    # Pages are built a few at a time: each holds up to max_sample_page_bytes of JSON several times over (rows,
    # parsed samples, the answer), and 32 concurrent readers must not cost 32 pages of memory or starve /healthz.
    page_slots = threading.BoundedSemaphore(CONCURRENT_SAMPLE_PAGES)

    def existing_job(job_id: str) -> EvaluationJob:
        job = store.get(job_id)
        if job is None:
            raise HTTPException(404, f"no evaluation job {job_id!r}")
        return job

    @router.post("", status_code=202, response_model=EvaluationJob, responses=_errors(411, 413, 429))
    def submit(request: EvaluationRequest, response: Response) -> EvaluationJob:
        """Queue an evaluation job; poll GET /v1/evaluations/{id} for progress and results."""
        if store.count(JobStatus.QUEUED) >= config.limits.max_queued_jobs:
            raise HTTPException(429, f"{config.limits.max_queued_jobs} jobs are already queued; retry later")
        try:
            progress = validate_request(request, config)
        except (DatasetError, ValueError) as err:
            raise HTTPException(422, str(err)) from err
        job = store.create(request, progress)
        wake()
        response.headers["Location"] = f"/v1/evaluations/{job.id}"
        return job

    @router.get("", response_model=JobList)
    def list_jobs(query: Annotated[ListQuery, Query()]) -> JobList:
        return JobList(jobs=store.list(query.limit, query.status))

    @router.get("/{job_id}", response_model=EvaluationJob, responses=_errors(404))
    def get_job(job_id: JobId) -> EvaluationJob:
        """Status, progress and the per-dataset figures so far."""
        return existing_job(job_id)

    @router.get("/{job_id}/samples", response_model=SamplePage, responses=_errors(404))
    def job_samples(job_id: JobId, query: Annotated[SamplesQuery, Query()]) -> Response:
        """Every response of the job as scored (prompt, response, extracted answer, verdict, truncated), in pages
        of at most `limit` samples and the server's `max_sample_page_bytes` of JSON; a running job's so far."""
        with page_slots:
            page = store.samples(job_id, query.offset, query.limit, config.max_sample_page_bytes, query.dataset)
            if page is None:
                raise HTTPException(404, f"no evaluation job {job_id!r}")
            # Serialised once, as built (FastAPI would validate the page again first): its bytes are bounded.
            return Response(page.model_dump_json(), media_type="application/json")

    @router.delete("/{job_id}", response_model=EvaluationJob, responses=_errors(404, 409))
    def cancel_job(job_id: JobId) -> EvaluationJob:
        """Cancel a queued or running job (a running one stops after its current chunk of questions)."""
        applied, before = store.cancel(job_id)
        if not before:
            raise HTTPException(404, f"no evaluation job {job_id!r}")
        if not applied:
            raise HTTPException(409, f"job {job_id} already {before}: nothing to cancel")
        return existing_job(job_id)

    return router
