"""No client can hold a gRPC server's threads with streams (issues 31 and 46).

A streaming call holds one of the server's threads for as long as it is open, whichever way it streams: sixteen
request streams (replay's `ImportPool`, rollout's `UpdateWeights`) that opened and sent nothing, or sixteen response
streams (replay's `ExportPool`) whose client never read, took every thread, and the health check and every other call
timed out behind them. `StreamGuardInterceptor` bounds every way a stream holds a thread:
- at most `max_streams` calls of one streaming method at once; one more is refused at once with RESOURCE_EXHAUSTED,
  so the other methods and the health check always keep `threads - max_streams x streaming methods` threads;
- a stream stalled on its client for `idle_timeout_s` is cancelled: the handler waits for a message the client does
  not send, or a response cannot be written because the client does not read (gRPC's flow control). The time the
  handler spends working does not count, and neither does a message that carries nothing: an empty message keeps
  the clock running, and a handler can say a parsed message carried nothing with `no_progress()`;
- a stream open for longer than `max_duration_s` is cancelled however it behaves, so one that trickles just enough
  to stay under the idle timeout still ends.
A watchdog thread checks once a second, so each bound holds to within a second.
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
# The request stream whose handler runs on this thread, for `no_progress`.
_handling = threading.local()


class _Stream:
    """One admitted streaming call: its slot, since when it runs, and since when it is stalled on its client."""

    def __init__(self, context: grpc.ServicerContext, method: str, slot: threading.BoundedSemaphore):
        self.context, self.method, self._slot = context, method, slot
        self.started = time.monotonic()
        # Set while the call waits on its client (None while the handler works); read by the watchdog.
        self.stalled_since: float | None = None
        self.stall = ""
        # When the wait for the last message began: `no_progress` resumes the clock from there.
        self.last_wait_since: float | None = None
        self._ended = False
        self._lock = threading.Lock()

    def end(self) -> bool:
        """Gives the slot back, once however the call ends; False when it was already given back."""
        with self._lock:
            if self._ended:
                return False
            self._ended = True
        self._slot.release()
        return True


def no_progress() -> None:
    """Called by a request stream's handler on the thread that read the message: the message it just received
    carried nothing (e.g. an ImportPool chunk with no question and no trajectory), so it does not restart the idle
    clock. Does nothing outside a guarded request stream."""
    stream = getattr(_handling, "stream", None)
    if stream is not None and stream.last_wait_since is not None:
        stream.stalled_since, stream.stall = stream.last_wait_since, "sent nothing"


class _Watch:
    """The admitted streams; cancels those stalled for `idle_timeout_s` or open for `max_duration_s`."""

    def __init__(self, idle_timeout_s: float, max_duration_s: float):
        self.idle_timeout_s, self.max_duration_s = idle_timeout_s, max_duration_s
        self._streams: set[_Stream] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-watch", daemon=True)
        self._thread.start()

    def add(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.add(stream)

    def remove(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def _overdue(self, stream: _Stream, now: float) -> str | None:
        if now - stream.started > self.max_duration_s:
            return f"open for more than {self.max_duration_s:.0f} s (the streams' total-duration bound)"
        stalled_since = stream.stalled_since  # read once: the handler's thread sets it
        if stalled_since is not None and now - stalled_since > self.idle_timeout_s:
            return f"the client {stream.stall} for {self.idle_timeout_s:.0f} s"
        return None

    def _run(self) -> None:
        while not self._stop.wait(WATCH_PERIOD_S):
            now = time.monotonic()
            with self._lock:
                expired = [(s, why) for s in self._streams if (why := self._overdue(s, now)) is not None]
                for stream, _ in expired:
                    self._streams.discard(stream)
            for stream, why in expired:
                log.warning("%s: %s; call cancelled", stream.method, why)
                stream.context.cancel()


class _WatchedRequests:
    """A request iterator that marks its stream stalled while it waits for the client's next message."""

    def __init__(self, requests: Iterator[Any], stream: _Stream):
        self._requests, self._stream = requests, stream

    def __iter__(self) -> _WatchedRequests:
        return self

    def __next__(self) -> Any:
        stream = self._stream
        if stream.stalled_since is None:  # still set after a message that carried nothing: the clock runs on
            stream.stalled_since, stream.stall = time.monotonic(), "sent nothing"
        stream.last_wait_since = stream.stalled_since
        try:
            message = next(self._requests)
        except BaseException:
            stream.stalled_since = None  # the stream ended: what the handler does now is its own work
            raise
        # The guard sees serialized messages: an empty one (all fields default) is no progress.
        if not isinstance(message, bytes) or message:
            stream.stalled_since = None
        return message


def _watched_responses(responses: Iterator[Any], stream: _Stream, watch: _Watch) -> Iterator[Any]:
    """`responses`, the stream marked stalled while gRPC writes each one, then the slot back."""
    try:
        for response in responses:  # computing the next response is the handler's work, not a stall
            stream.stalled_since, stream.stall = time.monotonic(), "read nothing"
            yield response  # gRPC asks for the next one once this one is written (flow control permitting)
            stream.stalled_since = None
    finally:
        watch.remove(stream)
        stream.end()


class StreamGuardInterceptor(grpc.ServerInterceptor):
    def __init__(self, max_streams: int, idle_timeout_s: float, max_duration_s: float):
        self._max_streams = max_streams
        self._slots: dict[str, threading.BoundedSemaphore] = {}
        self._slots_lock = threading.Lock()
        self.watch = _Watch(idle_timeout_s, max_duration_s)

    def _slot(self, method: str) -> threading.BoundedSemaphore:
        with self._slots_lock:
            return self._slots.setdefault(method, threading.BoundedSemaphore(self._max_streams))

    def _admit(self, method: str, context: grpc.ServicerContext) -> _Stream:
        slot = self._slot(method)
        if not slot.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_streams} {method.rsplit('/', 1)[-1]} calls are already streaming to this server; "
                "retry later",
            )
        stream = _Stream(context, method, slot)
        # However the call ends (a response stream gRPC stops iterating, a cancellation), the slot comes back.
        context.add_callback(lambda: (self.watch.remove(stream), stream.end()))
        self.watch.add(stream)
        return stream

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        method = handler_call_details.method
        kind = (handler.request_streaming, handler.response_streaming)

        def guarded(request_or_requests: Any, context: grpc.ServicerContext):
            stream = self._admit(method, context)
            if not handler.request_streaming:
                return _watched_responses(handler.unary_stream(request_or_requests, context), stream, self.watch)
            watched = _WatchedRequests(request_or_requests, stream)
            if handler.response_streaming:
                return _watched_responses(handler.stream_stream(watched, context), stream, self.watch)
            _handling.stream = stream
            try:
                return handler.stream_unary(watched, context)
            finally:
                _handling.stream = None
                self.watch.remove(stream)
                stream.end()

        return HANDLER_KINDS[kind](
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
