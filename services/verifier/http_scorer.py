"""A remote scorer over HTTP (e.g. a reward model served elsewhere): bounded, retried POSTs of one item or a batch.

An item is `{"response", "ground_truth", "extra", "data_source"}`; its answer a finite number or `{"score": number,
"extracted_answer"?: string}` (checked by `score_of`, strict JSON: NaN and Infinity are refused). With `batch_size`
1 the body is one item and the answer one answer; above 1 the body is a JSON list of up to `batch_size` items and
the answer must be a list of as many answers, in order (a reward model scores a batch in one forward pass, as
OpenRLHF's remote reward model takes one). In a batch's answer an entry that is not a score is that item's ERROR, a
list of the wrong length every item's. What bounds a request: `timeout_s` per connect and per read, the whole answer
read within `timeout_s` (plus one read), at most `max_response_bytes` per item, `1 + retries` attempts,
`max_concurrency` requests at once. Retried: 5xx, 429, timeouts and connection errors, after `backoff_s`, doubled
each time. Not retried: other 4xx (a wrong token stays wrong), redirects (never followed: they would carry the token
elsewhere), bad bodies. Every failure is its items' ERROR verdict (TIMEOUT when the last attempt timed out); the
call goes on.

The bearer token is read from its file once, at start, and is never logged; logs name the URL and status only.
Proxies from the environment are not used: the scorer's URL is reached directly.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from rlep.common.files import read_token_file
from rlep.common.strict_json import strict_loads
from rlep.common.types import Verdict
from rlep.services.verifier.config import HttpScorer
from rlep.services.verifier.judge import CheckResult
from rlep.services.verifier.pool import VerifyBatch
from rlep.services.verifier.python_scorer import parse_extra, score_of, verdict_of

log = logging.getLogger(__name__)

_READ_CHUNK = 65_536


class _Retryable(Exception):
    """A failure that may clear up on its own (5xx, 429, timeout, connection refused)."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.timed_out = timed_out


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


class RemoteScorer:
    """Scores items with one HTTP scorer; `submit` fills positions of a `VerifyBatch` from its own threads.

    Args:
        spec: the scorer's config.
        data_source: the label it serves (sent with each item).
        max_answer_chars: `extracted_answer` is cut to this length.
        on_skip: called once per item dropped unscored because its batch was cancelled (metrics).
    """

    def __init__(
        self, spec: HttpScorer, data_source: str, max_answer_chars: int, on_skip: Callable[[], None] | None = None
    ):
        self._spec, self._data_source, self._max_answer_chars = spec, data_source, max_answer_chars
        self._on_skip = on_skip or (lambda: None)
        token = read_token_file(spec.auth_token_file)
        self._headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
        self._executor = ThreadPoolExecutor(spec.max_concurrency, thread_name_prefix="http-scorer")

    def submit(self, batch: VerifyBatch, items: Sequence[tuple[int, tuple[str, str, str]]]) -> None:
        """Scores (position, (response, ground_truth, extra)) items into `batch`, `batch_size` per request, skipping
        them once it is cancelled."""
        size = self._spec.batch_size
        for start in range(0, len(items), size):
            self._executor.submit(self._score_into, batch, items[start : start + size])

    def _score_into(self, batch: VerifyBatch, chunk: Sequence[tuple[int, tuple[str, str, str]]]) -> None:
        if batch.cancelled:
            for _ in chunk:
                self._on_skip()
            return
        results = self.score_many([item for _, item in chunk], cancelled=lambda: batch.cancelled)
        for (index, _), result in zip(chunk, results, strict=True):
            batch.set_result(index, result)

    def score(
        self, response: str, ground_truth: str, extra: str, cancelled: Callable[[], bool] = lambda: False
    ) -> CheckResult:
        """One item's result, sent alone whatever `batch_size` is; every outcome is a verdict."""
        return self._request([(response, ground_truth, extra)], batched=False, cancelled=cancelled)[0]

    def score_many(
        self, items: Sequence[tuple[str, str, str]], cancelled: Callable[[], bool] = lambda: False
    ) -> list[CheckResult]:
        """Results of (response, ground_truth, extra) items, in one request (a list when `batch_size` > 1)."""
        if len(items) > self._spec.batch_size:
            raise ValueError(f"{len(items)} items in one request; batch_size is {self._spec.batch_size}")
        return self._request(items, batched=self._spec.batch_size > 1, cancelled=cancelled)

    def _request(
        self, items: Sequence[tuple[str, str, str]], batched: bool, cancelled: Callable[[], bool]
    ) -> list[CheckResult]:
        started = time.perf_counter()
        bodies = [
            {"response": r, "ground_truth": g, "extra": parse_extra(e), "data_source": self._data_source}
            for r, g, e in items
        ]
        body = json.dumps(bodies if batched else bodies[0]).encode()
        failure = Verdict.ERROR
        for attempt in range(1 + self._spec.retries):
            if attempt:
                time.sleep(self._spec.backoff_s * 2 ** (attempt - 1))
            if cancelled():
                break
            try:
                answer = self._post(body, self._spec.max_response_bytes * len(items))
                answers = self._answers(answer, len(items)) if batched else [answer]
            except _Retryable as err:
                log.warning("http scorer %s: attempt %d failed: %s", self._spec.url, attempt + 1, err)
                failure = Verdict.TIMEOUT if err.timed_out else Verdict.ERROR
                continue
            except ValueError as err:  # a 4xx, a redirect, or a body that is not a score: retrying will not help
                log.warning("http scorer %s: %s", self._spec.url, err)
                failure = Verdict.ERROR
                break
            seconds = (time.perf_counter() - started) / len(items)
            return [self._result(one, seconds) for one in answers]
        seconds = (time.perf_counter() - started) / len(items)
        return [CheckResult(failure, "", seconds) for _ in items]

    @staticmethod
    def _answers(answer: object, count: int) -> list[object]:
        if not isinstance(answer, list) or len(answer) != count:
            got = f"a list of {len(answer)}" if isinstance(answer, list) else type(answer).__name__
            raise ValueError(f"a batch of {count} items needs a list of {count} answers, not {got}")
        return answer

    def _result(self, answer: object, seconds: float) -> CheckResult:
        """One item's answer as its result: ERROR when it is not a score (the other items of its batch stand)."""
        try:
            score, extracted = score_of(answer, self._max_answer_chars)
        except ValueError as err:
            log.warning("http scorer %s: %s", self._spec.url, err)
            return CheckResult(Verdict.ERROR, "", seconds)
        return CheckResult(verdict_of(score, self._spec.success_threshold), extracted, seconds, score)

    def _post(self, body: bytes, max_bytes: int) -> object:
        """The parsed answer; `_Retryable` or ValueError (see `_request`)."""
        spec = self._spec
        request = urllib.request.Request(spec.url, data=body, headers=self._headers, method="POST")
        try:
            with self._opener.open(request, timeout=spec.timeout_s) as reply:
                text = _read_bounded(reply, max_bytes, time.monotonic() + spec.timeout_s)
        except urllib.error.HTTPError as err:
            if err.code >= 500 or err.code == 429:
                raise _Retryable(f"HTTP {err.code}") from None
            raise ValueError(f"HTTP {err.code}; not retried") from None
        except TimeoutError as err:
            raise _Retryable(f"timed out after {spec.timeout_s:g} s", timed_out=True) from err
        except urllib.error.URLError as err:
            timed_out = isinstance(err.reason, TimeoutError)
            raise _Retryable(f"cannot reach it: {err.reason}", timed_out=timed_out) from None
        except (ConnectionError, OSError) as err:  # reset mid-answer, or a malformed status line
            raise _Retryable(f"connection failed: {type(err).__name__}") from None
        try:
            return strict_loads(text)
        except ValueError as err:  # JSONDecodeError, NaN or Infinity
            raise ValueError(f"the answer is not strict JSON: {err}") from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _read_bounded(reply: object, max_bytes: int, deadline: float) -> bytes:
    """The body, refused past `max_bytes` or once reading it runs past `deadline` (a server dripping bytes)."""
    chunks, size = [], 0
    while chunk := reply.read(min(_READ_CHUNK, max_bytes + 1 - size)):  # type: ignore[attr-defined]
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise ValueError(f"the answer is over max_response_bytes ({max_bytes})")
        if time.monotonic() > deadline:
            raise TimeoutError("the answer took too long to read")
    return b"".join(chunks)
