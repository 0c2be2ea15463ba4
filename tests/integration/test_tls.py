"""TLS on a service's gRPC port and /metrics, from a self-signed certificate made here: TLS clients trusting it
get through, plaintext clients do not."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import ssl
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.grpc_server import build_server
from rlep.common.lifecycle import start_metrics
from rlep.common.metrics import service_registry
from rlep.common.tls import CA_FILE_ENV, SERVER_NAME_ENV, server_ssl_context

pytestmark = pytest.mark.integration


def self_signed(directory) -> tuple:
    """A certificate for localhost and 127.0.0.1, valid for a day, and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    alt_names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    cert_file, key_file = self_signed(tmp_path_factory.mktemp("tls"))
    config = ServerConfig(port=0, metrics_port=0, tls_cert_file=cert_file, tls_key_file=key_file)
    server, port, _ = build_server(config, lambda _: None, [])
    registry = service_registry("tls")
    Counter("rlep_tls_probe_total", "Something to scrape.", registry=registry).inc()
    metrics = start_metrics(registry, config)
    yield port, metrics.port, cert_file
    metrics.stop()
    server.stop(grace=None)


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_grpc_over_tls_with_the_ca_and_not_in_plaintext(tls_server, monkeypatch):
    port, _, cert_file = tls_server
    assert health(make_channel(f"localhost:{port}", tls_ca_file=cert_file)) == health_pb2.HealthCheckResponse.SERVING
    monkeypatch.setenv(CA_FILE_ENV, str(cert_file))  # how a pod's clients are told (one variable for all)
    assert health(make_channel(f"127.0.0.1:{port}")) == health_pb2.HealthCheckResponse.SERVING
    # The name to expect instead of the address's host (Ray replicas are dialled by pod IP) is what is checked.
    monkeypatch.setenv(SERVER_NAME_ENV, "elsewhere.example")
    with pytest.raises(grpc.RpcError):
        health(make_channel(f"127.0.0.1:{port}"))
    monkeypatch.delenv(SERVER_NAME_ENV)
    monkeypatch.delenv(CA_FILE_ENV)
    with pytest.raises(grpc.RpcError) as err:
        health(make_channel(f"127.0.0.1:{port}"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_metrics_over_tls_with_the_ca_and_not_in_plaintext(tls_server):
    _, metrics_port, cert_file = tls_server
    context = ssl.create_default_context(cafile=str(cert_file))
    with urllib.request.urlopen(f"https://localhost:{metrics_port}/metrics", context=context, timeout=5) as reply:
        assert b'rlep_tls_probe_total{service="tls"} 1.0' in reply.read()
    with urllib.request.urlopen(f"https://127.0.0.1:{metrics_port}/healthz", context=context, timeout=5) as reply:
        assert reply.read() == b"ok\n"
    # The server expects a TLS ClientHello and hangs up on plain HTTP without answering.
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=5).read()


def test_tls_files_go_in_pairs_and_must_exist(tmp_path):
    cert_file, key_file = self_signed(tmp_path)
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        ServerConfig(tls_cert_file=cert_file)
    with pytest.raises(ValueError, match="tls_key_file .* does not exist"):
        ServerConfig(tls_cert_file=cert_file, tls_key_file=tmp_path / "missing.key")
    both = ServerConfig(tls_cert_file=cert_file, tls_key_file=key_file)
    assert server_ssl_context(both) is not None and server_ssl_context(ServerConfig()) is None


def test_the_learners_metrics_serve_tls_when_configured(tmp_path):
    from rlep.common.config import TlsFiles
    from rlep.services.launch.training import _start_metrics
    from rlep.services.learner.config import TrainConfig

    cert_file, key_file = self_signed(tmp_path)
    config = TrainConfig(metrics_port=0, metrics_tls=TlsFiles(tls_cert_file=cert_file, tls_key_file=key_file))
    server, _ = _start_metrics(config)
    try:
        context = ssl.create_default_context(cafile=str(cert_file))
        with urllib.request.urlopen(f"https://localhost:{server.port}/healthz", context=context, timeout=5) as reply:
            assert reply.read() == b"ok\n"
        with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5).read()
    finally:
        server.stop()


def test_the_container_healthcheck_speaks_tls_with_the_ca(tls_server):
    import os
    import subprocess
    import sys
    from pathlib import Path

    port, metrics_port, cert_file = tls_server
    script = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"

    def check(env: dict, *args: str) -> int:
        return subprocess.run([sys.executable, str(script), *args], env={**os.environ, **env}, timeout=30).returncode

    with_ca = {CA_FILE_ENV: str(cert_file), SERVER_NAME_ENV: "localhost"}
    assert check(with_ca, "grpc", f"127.0.0.1:{port}") == 0
    assert check(with_ca, "http", f"https://localhost:{metrics_port}/healthz") == 0
    assert check({}, "grpc", f"127.0.0.1:{port}") == 1  # plaintext against a TLS port: not serving
