"""Assembling a service's gRPC server: request parsing inside the handler, the shared interceptors, health, binding.

Every server gets the same things: health checking (`grpc.health.v1`), reflection, an optional bearer token on
every RPC (`rlep.common.grpc_interceptors`), the stream guard (`rlep.common.stream_guard`), optional TLS
(`rlep.common.tls`), a bound on message size and one on the request bytes calls hold at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlep.common.config import ServerConfig
from rlep.common.grpc_interceptors import (
    HANDLER_KINDS,
    HEALTH_SERVICE,
    BearerAuthInterceptor,
    HealthThreadsInterceptor,
    RequestBytesInterceptor,
)
from rlep.common.stream_guard import StreamGuardInterceptor
from rlep.common.tls import grpc_server_credentials

# gRPC refuses messages beyond its own limit with RESOURCE_EXHAUSTED before our handler runs;
# the channel limit sits above the service's limit so our INVALID_ARGUMENT message is what users see.
CHANNEL_LIMIT_FACTOR = 2
# Threads kept for health checks beside `grpc_threads`: two, so one slow probe does not queue the next.
HEALTH_THREADS = 2


def add_validated_servicer(
    server: grpc.Server, service: ServiceDescriptor, servicer: object, max_request_bytes: int
) -> None:
    """Registers `servicer`'s methods for `service`, parsing requests inside the handler.

    The generated `add_*Servicer_to_server` lets gRPC deserialize requests, and a malformed message
    (e.g. invalid UTF-8 in a string field) then surfaces as INTERNAL. Parsing here turns it into
    INVALID_ARGUMENT with protobuf's reason, as for any other bad input. A servicer may name its own parser
    for a method in `request_parsers` (bytes -> request, raising DecodeError), e.g. to view a payload uncopied.

    A request (or a request stream's message) over `max_request_bytes` gets INVALID_ARGUMENT before it is parsed:
    its size is the length of the bytes received. Measured on the parsed message instead (`ByteSize()`), the
    check re-encoded every 60 MB request while holding the GIL, a quarter of the verifier's Python time under
    issue 46's mixed load, and health checks waited for it.
    """
    handlers = {}
    own_parsers = getattr(servicer, "request_parsers", {})
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        parse = _within(max_request_bytes, own_parsers.get(method.name, request_cls.FromString))
        if method.client_streaming:
            wrapped = _parse_stream(behaviour, request_cls, parse)
        else:
            wrapped = _parse_unary(behaviour, request_cls, parse)
        kind = HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(wrapped, response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class RequestTooLarge(Exception):
    """A request's bytes are over the service's `max_request_bytes`."""


def _within(limit_bytes: int, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_within(data: bytes) -> Any:
        if len(data) > limit_bytes:
            raise RequestTooLarge(f"request is {len(data)} bytes, over the limit of {limit_bytes}; split it")
        return parse(data)

    return parse_within


def _parse_or_abort(request_cls: type, parse: Callable[[bytes], Any], data: bytes, context) -> Any:
    try:
        return parse(data)
    except RequestTooLarge as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
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
    local_target: str | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Creates, binds and starts a server; `interceptors` run after the auth check. With `local_target` (a
    `unix:` socket in a private folder) it listens there too, without TLS: the health port's watcher.
    Returns `(server, bound_port, health_servicer)`."""
    token = config.read_auth_token()
    # Outermost first: health checks' own threads (health is exempt from auth, and no later wrapper may hide the
    # pool), auth, then the caller's (counting sees the RESOURCE_EXHAUSTED of the next two), then the bound on
    # request bytes held, then the stream guard.
    guard = StreamGuardInterceptor(config.stream_slots, config.stream_idle_timeout_s, config.stream_max_duration_s)
    request_bytes = RequestBytesInterceptor(config.inflight_request_bytes)
    auth = [BearerAuthInterceptor(token)] if token else []
    interceptors = [HealthThreadsInterceptor(HEALTH_THREADS), *auth, *interceptors, request_bytes, guard]
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
    if local_target is not None and server.add_insecure_port(local_target) == 0:
        raise OSError(f"could not bind {local_target}")
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer
