"""The server-side interceptors every gRPC server shares: bearer-token auth, a count of calls by final status and a
bound on the request bytes calls hold at once.

Both wrap a handler by rebuilding it with gRPC's factory for its streaming shape (`HANDLER_KINDS`, also used by
`rlep.common.stream_guard` and `rlep.common.grpc_server`). Health checks are exempt from auth because Kubernetes'
gRPC probes cannot send headers; they reveal nothing but "SERVING". The rule deciding a header is
`rlep.common.auth.check_bearer`, shared with the HTTP ports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
from prometheus_client import Counter

from rlep.common.auth import check_bearer, grpc_authorization_values

HEALTH_SERVICE = "grpc.health.v1.Health"
# gRPC's handler factory for each (request streaming, response streaming) shape.
HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose `authorization` metadata fails `check_bearer` with UNAUTHENTICATED."""

    def __init__(self, token: str):
        self._token = token

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return continuation(handler_call_details)
        values = grpc_authorization_values(handler_call_details.invocation_metadata)
        refusal = check_bearer(values, self._token)
        if refusal is None:
            return continuation(handler_call_details)

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)](deny)


class HealthThreadsInterceptor(grpc.ServerInterceptor):
    """Runs health checks (`Check`) on threads of their own, so a probe answers while large or slow calls hold every
    thread of the server's pool. gRPC receives a unary request on the thread that will handle it: sixteen callers
    sending 60 MB messages take the sixteen threads for as long as their bytes take to arrive, and a probe queued
    behind them waits as long. `Watch` streams stay on the server's pool: one per watcher, they would take these.

    Uses gRPC's per-method pool (`experimental_thread_pool` on the behaviour, read by `grpc._server`); without it
    the checks run on the shared pool as before.
    """

    def __init__(self, threads: int):
        self._pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc-health")

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method != f"/{HEALTH_SERVICE}/Check":
            return handler
        behaviour = handler.unary_unary

        def check(request: Any, context: grpc.ServicerContext) -> Any:
            return behaviour(request, context)

        check.experimental_thread_pool = self._pool
        return grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


class StatusCountInterceptor(grpc.ServerInterceptor):
    """Counts every call to one service into `counter`, labelled `(method, code)` or, with
    `by_method=False`, `(code,)`, where `code` is the call's final status name ("OK", "INVALID_ARGUMENT").

    The code is what the handler set (`context.abort` / `set_code`), UNKNOWN for an exception it let
    escape, CANCELLED or DEADLINE_EXCEEDED for a call whose caller had gone by the end, else OK. A
    streaming response is counted when its stream ends. Installed after the auth check, so refused
    callers are not counted, and before parsing, so malformed requests are.
    """

    def __init__(self, counter: Counter, service: str, by_method: bool = True):
        self._counter, self._prefix, self._by_method = counter, f"/{service}/", by_method

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        method = handler_call_details.method[len(self._prefix) :]

        def count(code: grpc.StatusCode) -> None:
            labels = (method, code.name) if self._by_method else (code.name,)
            self._counter.labels(*labels).inc()

        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        counted = _counted_stream(behaviour, count) if handler.response_streaming else _counted_unary(behaviour, count)
        return HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)](
            counted, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def _final_code(context: grpc.ServicerContext, otherwise: grpc.StatusCode) -> grpc.StatusCode:
    if (code := context.code()) is not None:
        return code
    if not context.is_active():  # nobody received the answer
        remaining = context.time_remaining()
        gone_by_deadline = remaining is not None and remaining <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if gone_by_deadline else grpc.StatusCode.CANCELLED
    return otherwise


def _counted_unary(behaviour: Callable, count: Callable[[grpc.StatusCode], None]) -> Callable:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            response = behaviour(request, context)
        except Exception:
            count(context.code() or grpc.StatusCode.UNKNOWN)
            raise
        count(_final_code(context, grpc.StatusCode.OK))
        return response

    return handler


def _counted_stream(behaviour: Callable, count: Callable[[grpc.StatusCode], None]) -> Callable:
    def handler(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behaviour(request, context)
        except GeneratorExit:  # gRPC stopped reading the stream: the caller went away
            count(_final_code(context, grpc.StatusCode.CANCELLED))
            raise
        except Exception:
            count(context.code() or grpc.StatusCode.UNKNOWN)
            raise
        count(_final_code(context, grpc.StatusCode.OK))

    return handler


class RequestBytesInterceptor(grpc.ServerInterceptor):
    """Bounds the request bytes (serialized size) that this server's calls hold at once; a call whose request would
    pass `limit_bytes` gets RESOURCE_EXHAUSTED, so a burst of large messages cannot take the memory and the threads
    that health and small calls need.

    A unary request is held for its whole call (a response stream's too); a request stream holds the message it is
    working on, from the moment the handler pulls it until it pulls the next. gRPC has received a message before any
    handler sees it, so the bound is on what is parsed and processed, not on what arrives. Requests reach this as
    bytes (`add_validated_servicer` registers no deserializer and parses in the innermost handler), so a refused call
    is never parsed: its size is `len(bytes)`, and only an admitted call pays for the parse. A call is admitted
    whatever its size when nothing is held, so a message at the channel's limit is never refused forever. Health
    checks are exempt.
    """

    def __init__(self, limit_bytes: int):
        self._limit, self._held, self._lock = limit_bytes, 0, threading.Lock()

    def _take(self, request: Any, context: grpc.ServicerContext) -> int:
        size = len(request) if isinstance(request, bytes | memoryview) else request.ByteSize()
        with self._lock:
            held = self._held
            if not held or held + size <= self._limit:
                self._held += size
                return size
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this server is handling {held} bytes of requests; {size} more would pass its bound of {self._limit} "
            "(max_inflight_request_bytes); retry later",
        )

    def _give(self, size: int) -> None:
        with self._lock:
            self._held -= size

    def _charged(self, requests: Iterable[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        """`requests`, each charged from the moment it is pulled until the next is pulled or the call ends."""
        held = 0
        try:
            for request in requests:
                self._give(held)
                held = 0
                held = self._take(request, context)
                yield request
        finally:
            self._give(held)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return handler
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        if handler.request_streaming:
            charge_call = _no_charge
            arguments = self._charged
        else:
            charge_call = self._take
            arguments = _as_is
        wrapped = _with_charge(behaviour, handler.response_streaming, charge_call, arguments, self._give)
        return HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)](
            wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def _no_charge(request: Any, context: grpc.ServicerContext) -> int:
    return 0


def _as_is(request: Any, context: grpc.ServicerContext) -> Any:
    return request


def _with_charge(behaviour: Callable, response_streaming: bool, charge_call, arguments, give) -> Callable:
    """`behaviour` holding `charge_call(request)` bytes for the call's whole life (responses streamed included),
    and seeing its request through `arguments` (a request stream charged message by message)."""

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        size = charge_call(request, context)
        argument = arguments(request, context)
        try:
            return behaviour(argument, context)
        finally:
            _close(argument)
            give(size)

    def streamed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        size = charge_call(request, context)
        argument = arguments(request, context)
        try:
            yield from behaviour(argument, context)
        finally:
            _close(argument)
            give(size)

    return streamed if response_streaming else unary


def _close(argument: Any) -> None:
    """Ends a charged request stream the handler stopped reading, which gives back its message's bytes."""
    if isinstance(argument, Iterator) and hasattr(argument, "close"):
        argument.close()
