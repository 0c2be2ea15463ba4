"""A remote scorer over HTTP (e.g. a reward model served elsewhere): bounded, retried POSTs of one item or a batch.

An item is `{"response", "ground_truth", "extra", "data_source"}`; its answer a finite number or `{"score": number,
"extracted_answer"?: string}` (checked by `score_of`, strict JSON: NaN and Infinity are refused). With `batch_size`
1 the body is one item and the answer one answer; above 1 the body is a JSON list of up to `batch_size` items and
the answer must be a list of as many answers, in order (a reward model scores a batch in one forward pass, as
OpenRLHF's remote reward model takes one). In a batch's answer an entry that is not a score is that item's ERROR, a
list of the wrong length every item's. What bounds a request: `timeout_s` for the whole of one attempt (connect,
request, status and headers, body: a watchdog cuts the connection at the deadline, so a server dripping one byte at a
time cannot stretch it), at most `max_response_bytes` per item, JSON nested at most `MAX_JSON_DEPTH` deep,
`1 + retries` attempts, `max_concurrency` requests at once. Retried: 5xx, 429, timeouts and connection errors, after
`backoff_s`, doubled each time. Not retried: other 4xx (a wrong token stays wrong), redirects (never followed: they
would carry the token elsewhere), bad bodies. Every failure, an unexpected exception included, is its items' ERROR
verdict (TIMEOUT when the last attempt timed out); the call goes on.

The bearer token is read from its file once, at start, and is never logged; logs name the URL with its password
masked (`redact_url`) and the status only. A URL's user-info (`https://user:password@host/`) is sent as basic auth
unless a token file is given. Proxies from the environment are not used: the scorer's URL is reached directly.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote, urlsplit

from rlep.common.files import read_token_file
from rlep.common.redaction import redact_url
from rlep.common.strict_json import strict_loads
from rlep.common.types import Verdict
from rlep.services.verifier.config import HttpScorer
from rlep.services.verifier.judge import CheckResult
from rlep.services.verifier.pool import VerifyBatch
from rlep.services.verifier.python_scorer import one_line, parse_extra, score_of, verdict_of

log = logging.getLogger(__name__)

_READ_CHUNK = 65_536


class _Retryable(Exception):
    """A failure that may clear up on its own (5xx, 429, timeout, connection refused)."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.timed_out = timed_out


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
        self._where = redact_url(spec.url)  # what logs name: never the URL's password
        parts = urlsplit(spec.url)
        self._host, self._port, self._tls = parts.hostname or "", parts.port, parts.scheme == "https"
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._headers = {"content-type": "application/json"}
        if parts.username is not None:  # user-info is credentials for basic auth, as curl and requests read it
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self._headers["authorization"] = f"Basic {base64.b64encode(pair).decode()}"
        if token := read_token_file(spec.auth_token_file):
            if parts.username is not None:
                log.warning("http scorer %s: auth_token_file is given, so the URL's user-info is not sent", self._where)
            self._headers["authorization"] = f"Bearer {token}"
        self._tls_context = ssl.create_default_context() if self._tls else None
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
        try:
            results = self.score_many([item for _, item in chunk], cancelled=lambda: batch.cancelled)
        except Exception:  # a bug here must not leave the batch waiting for positions nobody will fill
            log.exception("http scorer %s: scoring %d items failed", self._where, len(chunk))
            results = [CheckResult(Verdict.ERROR, "", 0.0, error="the scorer's client failed (logged)") for _ in chunk]
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
        failure, reason = Verdict.ERROR, "cancelled before it was sent"
        for attempt in range(1 + self._spec.retries):
            if attempt:
                time.sleep(self._spec.backoff_s * 2 ** (attempt - 1))
            if cancelled():
                break
            try:
                answer = self._post(body, self._spec.max_response_bytes * len(items))
                answers = self._answers(answer, len(items)) if batched else [answer]
            except _Retryable as err:
                log.warning("http scorer %s: attempt %d failed: %s", self._where, attempt + 1, err)
                failure, reason = Verdict.TIMEOUT if err.timed_out else Verdict.ERROR, one_line(err)
                continue
            except Exception as err:  # a 4xx, a redirect, a body that is not a score: retrying will not help
                log.warning("http scorer %s: %s", self._where, err)
                failure, reason = Verdict.ERROR, one_line(err)
                break
            seconds = (time.perf_counter() - started) / len(items)
            return [self._result(one, seconds) for one in answers]
        seconds = (time.perf_counter() - started) / len(items)
        return [CheckResult(failure, "", seconds, error=reason) for _ in items]

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
        except Exception as err:  # not a score; or one that overflows a float (`1` and 400 zeros)
            log.warning("http scorer %s: %s", self._where, err)
            return CheckResult(Verdict.ERROR, "", seconds, error=one_line(err))
        return CheckResult(verdict_of(score, self._spec.success_threshold), extracted, seconds, score)

    def _post(self, body: bytes, max_bytes: int) -> object:
        """The parsed answer within one `timeout_s`; `_Retryable` or ValueError (see `_request`)."""
        timeout_s = self._spec.timeout_s
        if self._tls:
            connection = http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout_s, context=self._tls_context
            )
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        # Socket timeouts bound each read, not their sum: at the deadline the watchdog shuts the socket down, which
        # ends a read in progress (a status line or a body dripped one byte at a time).
        expired, connected, reply = threading.Event(), [], None
        watchdog = threading.Timer(timeout_s, _cut, (connection, connected, expired))
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.connect()
            connected.append(connection.sock)  # a reply read to the end takes the socket off the connection
            if time.monotonic() >= deadline:  # the watchdog fired while the connection was being made
                raise TimeoutError("connecting took the whole timeout")
            connection.request("POST", self._path, body, self._headers)
            reply = connection.getresponse()
            if not 200 <= reply.status < 300:
                if reply.status >= 500 or reply.status == 429:
                    raise _Retryable(f"HTTP {reply.status}")
                raise ValueError(f"HTTP {reply.status}; not retried")
            text = _read_bounded(reply, max_bytes, deadline)
            if expired.is_set():  # a body read until the connection closed may have been cut short
                raise TimeoutError("the answer took too long")
        except (TimeoutError, OSError, http.client.HTTPException) as err:
            if expired.is_set() or isinstance(err, TimeoutError):
                raise _Retryable(f"timed out after {timeout_s:g} s", timed_out=True) from None
            raise _Retryable(f"connection failed: {type(err).__name__}: {err}") from None
        finally:
            watchdog.cancel()
            if reply is not None:
                reply.close()
            connection.close()
        try:
            return strict_loads(text)
        except ValueError as err:  # JSONDecodeError, NaN, Infinity, nested past MAX_JSON_DEPTH
            raise ValueError(f"the answer is not strict JSON: {err}") from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _cut(connection: http.client.HTTPConnection, connected: list[socket.socket], expired: threading.Event) -> None:
    """The watchdog's end of an attempt: shuts the socket down, so the read blocked on it returns."""
    expired.set()
    for sock in (connection.sock, *connected):  # still connecting; or connected
        if sock is not None:
            # The plain socket's shutdown: an SSL socket's own would also drop its TLS state under the reader.
            # OSError: the attempt closed it in the meantime.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)


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
