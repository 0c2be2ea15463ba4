"""The server-side interceptors every gRPC server shares: bearer-token auth and a count of calls by final status.

Both wrap a handler by rebuilding it with gRPC's factory for its streaming shape (`HANDLER_KINDS`, also used by
`rlep.common.stream_guard` and `rlep.common.grpc_server`). Health checks are exempt from auth because Kubernetes'
gRPC probes cannot send headers; they reveal nothing but "SERVING". The rule deciding a header is
`rlep.common.auth.check_bearer`, shared with the HTTP ports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
