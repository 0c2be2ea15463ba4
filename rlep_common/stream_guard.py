"""No client can hold a gRPC server's threads with request streams (issue 31).

A request-streaming call (replay's `ImportPool`, rollout's `UpdateWeights`) holds one of the server's threads for as
long as it is open; sixteen that opened, sent nothing and set no deadline took every thread, and the health check and
every other call timed out behind them. `StreamGuardInterceptor` bounds both ways a stream holds a thread:
- at most `max_streams` calls of one method at once; one more is refused at once with RESOURCE_EXHAUSTED, so the
  other methods and the health check always keep `threads - max_streams x streaming methods` threads;
- a stream whose client sends nothing for `idle_timeout_s` while the handler waits for its next message is cancelled
  (the time the handler spends working between two messages does not count). A watchdog thread checks once a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from rlep.common.grpc_interceptors import HANDLER_KINDS

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 1.0


class _IdleWatch:
    """The streams whose handler is waiting for a message, and since when; cancels those waiting too long."""

    def __init__(self, idle_timeout_s: float):
        self.idle_timeout_s = idle_timeout_s
        self._waiting: dict[int, tuple[float, grpc.ServicerContext, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-idle-watch", daemon=True)
        self._thread.start()

    def waiting(self, key: int, context: grpc.ServicerContext, method: str) -> None:
        with self._lock:
            self._waiting[key] = (time.monotonic(), context, method)

    def received(self, key: int) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(WATCH_PERIOD_S):
            now = time.monotonic()
            with self._lock:
                stale = [k for k, (since, _, _) in self._waiting.items() if now - since > self.idle_timeout_s]
                expired = [self._waiting.pop(k) for k in stale]
            for _, context, method in expired:
                log.warning("%s: the client sent nothing for %.0f s; call cancelled", method, self.idle_timeout_s)
                context.cancel()


class _WatchedRequests:
    """A request iterator that tells the watch while it waits for the client's next message."""

    def __init__(self, requests: Iterator[Any], context: grpc.ServicerContext, watch: _IdleWatch, method: str):
        self._requests, self._context, self._watch, self._method = requests, context, watch, method

    def __iter__(self) -> _WatchedRequests:
        return self

    def __next__(self) -> Any:
        self._watch.waiting(id(self), self._context, self._method)
        try:
            return next(self._requests)
        finally:
            self._watch.received(id(self))


class StreamGuardInterceptor(grpc.ServerInterceptor):
    def __init__(self, max_streams: int, idle_timeout_s: float):
        self._max_streams = max_streams
        self._slots: dict[str, threading.BoundedSemaphore] = {}
        self._slots_lock = threading.Lock()
        self.watch = _IdleWatch(idle_timeout_s)

    def _slot(self, method: str) -> threading.BoundedSemaphore:
        with self._slots_lock:
            return self._slots.setdefault(method, threading.BoundedSemaphore(self._max_streams))

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler.request_streaming:
            return handler
        method = handler_call_details.method
        slot = self._slot(method)
        limit = self._max_streams

        def guarded(requests: Iterator[Any], context: grpc.ServicerContext):
            if not slot.acquire(blocking=False):
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{limit} {method.rsplit('/', 1)[-1]} calls are already streaming to this server; retry later",
                )
            watched = _WatchedRequests(requests, context, self.watch, method)
            if not handler.response_streaming:
                try:
                    return handler.stream_unary(watched, context)
                finally:
                    slot.release()
            return _released_after(handler.stream_stream(watched, context), slot)

        return HANDLER_KINDS[(True, handler.response_streaming)](
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _released_after(responses: Iterator[Any], slot: threading.BoundedSemaphore) -> Iterator[Any]:
    """`responses`, then the stream's slot back (however the stream ends)."""
    try:
        yield from responses
    finally:
        slot.release()
