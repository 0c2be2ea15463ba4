"""How the replay service reports failure: store and Redis errors as gRPC codes, callers that went away,
and Redis trouble logged once per episode (not once per failed call, and never as a traceback)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import grpc
import redis
from prometheus_client import Counter

from rlep.services.replay.requests import LimitExceeded
from rlep.services.replay.types import PoolNotFound

log = logging.getLogger("rlep.services.replay")

OUT_OF_MEMORY = "out of memory"
UNREACHABLE = "unreachable"


class CallAbandoned(Exception):
    """The caller cancelled or its deadline passed: the work stops here."""

    def __init__(self, code: grpc.StatusCode):
        super().__init__(code.name)
        self.code = code


def keep_going_check(context: grpc.ServicerContext) -> Callable[[], None]:
    """A check to call between units of work; raises CallAbandoned once nobody waits for the answer."""

    def check() -> None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise CallAbandoned(grpc.StatusCode.DEADLINE_EXCEEDED)
        if not context.is_active():
            raise CallAbandoned(grpc.StatusCode.CANCELLED)

    return check


class RedisHealth:
    """Logs a Redis problem when it starts and when it ends, once each.

    "Out of memory" ends only with a successful write: reads keep working while Redis is full.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._problem: str | None = None

    def failed(self, problem: str, detail: str) -> None:
        with self._lock:
            if self._problem == problem:
                return
            self._problem = problem
        log.error("Redis %s: %s (logged once until it recovers)", problem, detail)

    def succeeded(self, wrote: bool) -> None:
        if self._problem is None or (self._problem == OUT_OF_MEMORY and not wrote):
            return
        with self._lock:
            previous, self._problem = self._problem, None
        if previous:
            log.warning("Redis works again (was %s)", previous)


@contextlib.contextmanager
def status_for_errors(
    redis_errors: Counter, health: RedisHealth, context: grpc.ServicerContext, wrote: bool = False
) -> Iterator[None]:
    """Maps store and Redis errors to gRPC codes (the server's interceptor counts each call's code)."""
    try:
        yield
        health.succeeded(wrote)
    except PoolNotFound as err:
        context.abort(grpc.StatusCode.NOT_FOUND, f"unknown pool {err.args[0]!r}")
    except LimitExceeded as err:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
    except CallAbandoned as err:
        context.abort(err.code, f"stopped: the caller is gone ({err.code.name})")
    except redis.OutOfMemoryError as err:
        redis_errors.inc()
        health.failed(OUT_OF_MEMORY, str(err))
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Redis is out of memory (maxmemory reached, nothing evicted): nothing was stored; "
            "drop a pool or give Redis more memory",
        )
    except (redis.ConnectionError, redis.TimeoutError) as err:
        redis_errors.inc()
        health.failed(UNREACHABLE, f"{type(err).__name__}: {err}")
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"Redis unavailable ({type(err).__name__}); the call may or may not have taken effect. "
            "Retrying is safe: adds are idempotent",
        )
    except redis.ResponseError as err:
        redis_errors.inc()
        busy = str(err).startswith("BUSY")
        health.failed("busy" if busy else "error", str(err))
        context.abort(
            grpc.StatusCode.UNAVAILABLE if busy else grpc.StatusCode.INTERNAL, f"Redis answered an error: {err}"
        )
    except ValueError as err:  # a request check's InvalidRequest, or a value the sampling logic refuses
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
