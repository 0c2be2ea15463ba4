"""Typed HTTP client of the eval service, used by `rlep eval` and the tests.

Reads (GET) and cancels (DELETE) are idempotent and retried on transport errors and 5xx, which clear up
on their own (a restarting service, Redis failing over); a submission is never retried, so it cannot
queue a job twice. A 4xx is the caller's mistake and raises `EvalApiError` with the server's reason.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from rlep.common.tls import resolve_ca_file
from rlep.services.eval.api import (
    TERMINAL_STATUSES,
    EvalSample,
    EvaluationJob,
    EvaluationRequest,
    JobList,
    JobStatus,
    SamplePage,
)

# Every endpoint answers from Redis (a submission also reads its datasets): seconds at most.
REQUEST_TIMEOUT_S = 60.0
RETRIES = 3
RETRY_BACKOFF_S = 0.5


class EvalApiError(RuntimeError):
    """The service refused a request; `status_code` and `detail` say why."""

    def __init__(self, status_code: int, detail: Any):
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code, self.detail = status_code, detail


def _detail(response: httpx.Response) -> Any:
    try:
        return response.json().get("detail", response.text)
    except ValueError:
        return response.text


class EvalClient:
    """`EvalClient("http://127.0.0.1:8080", token).submit(EvaluationRequest(...))`."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        tls_ca_file: Path | str | None = None,
    ):
        """An https `base_url` is verified against `tls_ca_file`, else `$RLEP_TLS_CA_FILE`, else the system CAs."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ca_file = resolve_ca_file(tls_ca_file)
        verify = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, verify=verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EvalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, retry: bool, **kwargs: Any) -> Any:
        for attempt in range(RETRIES if retry else 1):
            last = attempt == (RETRIES if retry else 1) - 1
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if last:
                    raise
            else:
                if response.is_success:
                    return response.json()
                if response.status_code < 500 or last:
                    raise EvalApiError(response.status_code, _detail(response))
            time.sleep(RETRY_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    def submit(self, request: EvaluationRequest) -> EvaluationJob:
        body = request.model_dump(mode="json")
        return EvaluationJob.model_validate(self._call("POST", "/v1/evaluations", retry=False, json=body))

    def get(self, job_id: str) -> EvaluationJob:
        return EvaluationJob.model_validate(self._call("GET", f"/v1/evaluations/{job_id}", retry=True))

    def list(self, limit: int = 50, status: JobStatus | None = None) -> list[EvaluationJob]:
        params: dict[str, Any] = {"limit": limit} | ({"status": status.value} if status else {})
        return JobList.model_validate(self._call("GET", "/v1/evaluations", retry=True, params=params)).jobs

    def cancel(self, job_id: str) -> EvaluationJob:
        return EvaluationJob.model_validate(self._call("DELETE", f"/v1/evaluations/{job_id}", retry=True))

    def samples(self, job_id: str, offset: int = 0, limit: int = 100, dataset: str | None = None) -> SamplePage:
        """One page of the job's responses as scored (limit: at most 1000)."""
        params: dict[str, Any] = {"offset": offset, "limit": limit} | ({"dataset": dataset} if dataset else {})
        body = self._call("GET", f"/v1/evaluations/{job_id}/samples", retry=True, params=params)
        return SamplePage.model_validate(body)

    def iter_samples(self, job_id: str, page_size: int = 1000, dataset: str | None = None) -> Iterator[EvalSample]:
        """Every stored response of the job, page by page (a running job's: those stored when each page is read)."""
        offset = 0
        while True:
            page = self.samples(job_id, offset, page_size, dataset)
            yield from page.samples
            offset += len(page.samples)
            if not page.samples or offset >= page.total:
                return

    def wait(
        self,
        job_id: str,
        timeout_s: float | None = None,
        poll_s: float = 1.0,
        on_update: Callable[[EvaluationJob], None] | None = None,
    ) -> EvaluationJob:
        """Polls until the job is succeeded, failed or cancelled; raises TimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if on_update is not None:
                on_update(job)
            if job.status in TERMINAL_STATUSES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout_s} s")
            time.sleep(poll_s)
