"""gRPC plumbing shared by every service: server assembly, bearer-token auth, client channels, retries.

Every server gets the same things: health checking (`grpc.health.v1`), reflection, an optional
bearer token on every RPC (rule: `rlep.common.auth.check_bearer`), optional TLS (`rlep.common.tls`),
a bound on message size, and a count of its calls by method and final status code. Health checks
are exempt from auth because Kubernetes' gRPC probes cannot send headers; they reveal nothing but
"SERVING".
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter

from rlep.common.auth import check_bearer, grpc_authorization_values
from rlep.common.config import ServerConfig
from rlep.common.tls import channel_credentials, channel_tls_options, grpc_server_credentials, resolve_ca_file

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
# Retrying helps only with errors that clear up on their own; a bad request stays bad.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# gRPC refuses messages beyond its own limit with RESOURCE_EXHAUSTED before our handler runs;
# the channel limit sits above the service's limit so our INVALID_ARGUMENT message is what users see.
CHANNEL_LIMIT_FACTOR = 2
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


def add_validated_servicer(server: grpc.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Registers `servicer`'s methods for `service`, parsing requests inside the handler.

    The generated `add_*Servicer_to_server` lets gRPC deserialize requests, and a malformed message
    (e.g. invalid UTF-8 in a string field) then surfaces as INTERNAL. Parsing here turns it into
    INVALID_ARGUMENT with protobuf's reason, as for any other bad input. A servicer may name its own parser
    for a method in `request_parsers` (bytes -> request, raising DecodeError), e.g. to view a payload uncopied.
    """
    handlers = {}
    own_parsers = getattr(servicer, "request_parsers", {})
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        parse = own_parsers.get(method.name, request_cls.FromString)
        if method.client_streaming:
            wrapped = _parse_stream(behaviour, request_cls, parse)
        else:
            wrapped = _parse_unary(behaviour, request_cls, parse)
        kind = HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(wrapped, response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _parse_or_abort(request_cls: type, parse: Callable[[bytes], Any], data: bytes, context) -> Any:
    try:
        return parse(data)
    except DecodeError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_cls.DESCRIPTOR.full_name}: {err}")


def _parse_unary(behaviour: Callable, request_cls: type, parse: Callable[[bytes], Any]) -> Callable:
    def handler(data: bytes, context: grpc.ServicerContext) -> Any:
        return behaviour(_parse_or_abort(request_cls, parse, data, context), context)

    return handler


def _parse_stream(behaviour: Callable, request_cls: type, parse: Callable[[bytes], Any]) -> Callable:
    def handler(chunks: Iterable[bytes], context: grpc.ServicerContext) -> Any:
        return behaviour((_parse_or_abort(request_cls, parse, c, context) for c in chunks), context)

    return handler


def build_server(
    config: ServerConfig,
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    interceptors: Iterable[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Creates, binds and starts a server; `interceptors` run after the auth check.
    Returns `(server, bound_port, health_servicer)`."""
    from rlep.common.stream_guard import StreamGuardInterceptor

    token = config.read_auth_token()
    # Outermost first: auth, then the caller's (counting sees the guard's RESOURCE_EXHAUSTED), then the stream guard.
    guard = StreamGuardInterceptor(config.stream_slots, config.stream_idle_timeout_s)
    interceptors = [*([BearerAuthInterceptor(token)] if token else []), *interceptors, guard]
    limit = config.max_request_bytes * CHANNEL_LIMIT_FACTOR
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.grpc_threads, thread_name_prefix="rpc"),
        interceptors=interceptors,
        # so_reuseport off: gRPC's default lets a second server bind a port already served, and the kernel
        # then splits connections between the two (a fixed rollout replica port taken twice, silently).
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    credentials = grpc_server_credentials(config)
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def check_request_size(request: Any, context: grpc.ServicerContext, limit_bytes: int) -> None:
    """Aborts with INVALID_ARGUMENT when a request exceeds the service's byte limit."""
    size = request.ByteSize()
    if size > limit_bytes:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"request is {size} bytes, over the limit of {limit_bytes}; split it"
        )


class _BearerClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]):
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def make_channel(
    address: str,
    token: str | None = None,
    max_message_bytes: int = 256 * 1024 * 1024,
    tls_ca_file: Path | str | None = None,
) -> grpc.Channel:
    """A channel that sends the bearer token when given.

    TLS when a CA bundle is named (`tls_ca_file`, else `$RLEP_TLS_CA_FILE`): the server's certificate
    must chain to it and match the address's host name (or `$RLEP_TLS_SERVER_NAME`). Otherwise plaintext.
    """
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    ca_file = resolve_ca_file(tls_ca_file)
    if ca_file is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, channel_credentials(ca_file), options=options + channel_tls_options())
    if token:
        channel = grpc.intercept_channel(channel, _BearerClientInterceptor(token))
    return channel


ResponseT = TypeVar("ResponseT")


# The longest wait between two tries of a server that does not answer (backoff doubles up to it).
MAX_RETRY_DELAY_S = 5.0


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


def unknown_field_paths(message: Any, path: str = "") -> list[str]:
    """Where a parsed message carries fields this schema does not know (e.g. a newer client's).

    Protobuf keeps unknown fields silently; services that would misread such a request (a sampling
    option they would ignore, say) refuse it instead.
    """
    from google.protobuf.descriptor import FieldDescriptor
    from google.protobuf.unknown_fields import UnknownFieldSet

    here = path or message.DESCRIPTOR.name
    found = [here] if len(UnknownFieldSet(message)) else []
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.message_type.GetOptions().map_entry:
            children = [(f"{here}.{field.name}[{k}]", v) for k, v in value.items() if hasattr(v, "DESCRIPTOR")]
        elif field.is_repeated:
            children = [(f"{here}.{field.name}[{i}]", v) for i, v in enumerate(value)]
        else:
            children = [(f"{here}.{field.name}", value)]
        for child_path, child in children:
            found.extend(unknown_field_paths(child, child_path))
    return found


def reject_unknown_fields(message: Any, context: grpc.ServicerContext) -> None:
    """Aborts with INVALID_ARGUMENT naming where unknown fields were sent."""
    paths = unknown_field_paths(message)
    if paths:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fields in {', '.join(paths[:5])}")
