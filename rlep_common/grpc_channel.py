"""Client channels to RLEP's gRPC services: message-size bounds, TLS when a CA bundle is named, and the bearer token
on every call when one is given."""

from __future__ import annotations

from pathlib import Path

import grpc

from rlep.common.tls import channel_credentials, channel_tls_options, resolve_ca_file


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
