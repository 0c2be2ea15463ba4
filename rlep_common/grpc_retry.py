"""Retrying a unary RPC: only the errors that can clear up on their own (UNAVAILABLE, DEADLINE_EXCEEDED), with
jittered exponential backoff and an optional budget for riding out a server's restart."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)

# Retrying helps only with errors that clear up on their own; a bad request stays bad.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# The longest wait between two tries of a server that does not answer (backoff doubles up to it).
MAX_RETRY_DELAY_S = 5.0

ResponseT = TypeVar("ResponseT")


def call_with_retry(
    call: Callable[..., ResponseT],
    request: Any,
    timeout_s: float,
    attempts: int = 3,
    backoff_s: float = 0.2,
    outage_s: float = 0.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> ResponseT:
    """Calls a unary RPC with a deadline, retrying only UNAVAILABLE and DEADLINE_EXCEEDED.

    Every failure is retried up to `attempts` tries in all. UNAVAILABLE (no server answers: one restarting, say)
    is also retried for as long as `outage_s` allows from the first failure, so a caller rides out a restart of
    bounded length; a DEADLINE_EXCEEDED costs a whole `timeout_s` and gets only the `attempts`.
    """
    first_failure: float | None = None
    attempt = 0
    while True:
        try:
            return call(request, timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() not in RETRYABLE_CODES:
                raise
            now = clock()
            first_failure = now if first_failure is None else first_failure
            outage_left = first_failure + outage_s - now if err.code() == grpc.StatusCode.UNAVAILABLE else 0.0
            if attempt >= attempts - 1 and outage_left <= 0:
                raise
            delay = min(backoff_s * 2 ** min(attempt, 16), MAX_RETRY_DELAY_S) * (1 + random.random())
            if attempt >= attempts - 1:  # past the plain tries: wait no longer than the outage budget has left
                delay = min(delay, outage_left)
            left = f"; {outage_left:.0f} s of a {outage_s:g}-s outage left" if outage_left > 0 else ""
            log.warning("%s: %s, retrying in %.2fs%s", err.code().name, err.details(), delay, left)
            sleep(delay)
            attempt += 1
