"""TLS for every listener and client, from PEM files (in Kubernetes: the chart's TLS Secret mounted as files).

Servers: `ServerConfig.tls_cert_file` / `tls_key_file` (class `TlsFiles`) turn TLS on for the gRPC port
(`grpc_server_credentials`), /metrics and eval's HTTP port (`server_ssl_context`).
Clients: `make_channel` trusts the CA bundle named by `RLEP_TLS_CA_FILE` (`CA_FILE_ENV`), or the
`tls_ca_file` it is given; without either it speaks plaintext, as before. `RLEP_TLS_SERVER_NAME` names
the certificate to expect when servers are dialled by IP.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import grpc

from rlep.common.config import TlsFiles

# An environment variable rather than a field in every client's config: clients are built in many places
# (learner, eval, CLI, tests), and in Kubernetes one variable per pod is how the chart turns TLS on.
CA_FILE_ENV = "RLEP_TLS_CA_FILE"
# Rollout replicas on Ray are dialled by pod IP, which a certificate rarely names; with this set, clients
# check the server's certificate against this name instead of the address's host.
SERVER_NAME_ENV = "RLEP_TLS_SERVER_NAME"


def grpc_server_credentials(config: TlsFiles) -> grpc.ServerCredentials | None:
    """Credentials for `server.add_secure_port`, or None when TLS is off."""
    pair = config.read_tls_pair()
    if pair is None:
        return None
    certificate, key = pair
    return grpc.ssl_server_credentials([(key, certificate)])


def server_ssl_context(config: TlsFiles) -> ssl.SSLContext | None:
    """A server-side context for an HTTP listener (TLS 1.2+), or None when TLS is off."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    return context


def resolve_ca_file(tls_ca_file: Path | str | None = None) -> Path | None:
    """The CA bundle a client should trust: the argument, else `$RLEP_TLS_CA_FILE`, else None (plaintext)."""
    chosen = tls_ca_file if tls_ca_file is not None else os.environ.get(CA_FILE_ENV) or None
    if chosen is None:
        return None
    path = Path(chosen)
    if not path.is_file():
        raise ValueError(f"TLS CA file {path} (from {CA_FILE_ENV} or tls_ca_file) does not exist")
    return path


def channel_credentials(ca_file: Path) -> grpc.ChannelCredentials:
    """Client credentials that verify the server against `ca_file` (PEM)."""
    return grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes())


def channel_tls_options() -> list[tuple[str, str]]:
    """Channel options for TLS: the certificate name to expect when `$RLEP_TLS_SERVER_NAME` is set."""
    name = os.environ.get(SERVER_NAME_ENV)
    return [("grpc.ssl_target_name_override", name)] if name else []
