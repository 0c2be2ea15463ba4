"""Prometheus endpoint shared by every service: `/metrics` (optionally behind a bearer token, optionally TLS)
and `/healthz`; and `MetricFactory`, how a service declares its series.

Each service owns a `CollectorRegistry` (no global state, so several services can live in one
process, as in tests) and serves it from a background thread. The HTTP server answers each
connection on its own thread, and every connection is bounded: at most `max_connections` at once
(more get 503 at once), a request head of at most `max_request_bytes` (else 431) that must arrive
within `head_timeout_s` (else the connection is dropped), and one request per connection. So a
slow or half-sent request holds one thread for a few seconds and never blocks a scrape or a probe.
"""

from __future__ import annotations

import io
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Sequence
from socketserver import ThreadingMixIn
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from rlep.common.auth import check_bearer

log = logging.getLogger(__name__)

# A scraper or probe sends its ~300-byte request at once; Prometheus gives up on a scrape after
# 10 s by default, so a client that has not sent its head after 5 s is not one we want to wait for.
HEAD_TIMEOUT_S = 5.0
# Writing the response (tens of KB) to a client that stopped reading must not hold a thread forever.
WRITE_TIMEOUT_S = 10.0
# Scrapers and probes need a handful of connections; the cap bounds threads under a connection flood.
MAX_CONNECTIONS = 32
# Request line plus headers; a scrape sends a few hundred bytes.
MAX_REQUEST_BYTES = 16 * 1024
AUTH_KEY = "rlep.authorization"


class ServiceRegistry(CollectorRegistry):
    """A registry whose every sample carries `service="<name>"`, so dashboards can tell services apart
    however they are scraped (one job per service, or a pod monitor over all of them)."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def collect(self):
        for metric in super().collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [
                Sample(
                    s.name, {**s.labels, "service": self.service}, s.value, s.timestamp, s.exemplar, s.native_histogram
                )
                for s in metric.samples
            ]
            yield labelled


def service_registry(service: str) -> CollectorRegistry:
    """The registry a service's metrics live in (one per service; no global state)."""
    return ServiceRegistry(service)


class MetricFactory:
    """Declares a service's series in its registry, one call per series."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def counter(
        self, name: str, documentation: str, labels: Sequence[str] = (), zero: Iterable[str | tuple[str, ...]] = ()
    ) -> Counter:
        """`zero`: label values exported at 0 before the first event, so rate() and increase() see that event."""
        counter = Counter(name, documentation, labels, registry=self._registry)
        for values in zero:
            counter.labels(*((values,) if isinstance(values, str) else values))
        return counter

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, documentation, labels, registry=self._registry)

    def histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(name, documentation, labels, registry=self._registry, buckets=buckets)


class _RequestTooLarge(Exception):
    pass


class _DeadlineReader(io.RawIOBase):
    """Socket input that fails once `deadline` (monotonic) passes or more than `limit` bytes arrive.

    A per-read socket timeout alone lets a client trickle one byte every few seconds forever.
    """

    def __init__(self, sock: socket.socket, deadline: float, limit: int):
        self._sock, self._deadline, self._left = sock, deadline, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request head not received in time")
        self._sock.settimeout(remaining)
        n = self._sock.recv_into(buffer)
        self._left -= n
        if self._left < 0:
            raise _RequestTooLarge
        return n


class _SocketWriter(io.RawIOBase):
    def __init__(self, sock: socket.socket):
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._sock.sendall(data)
        return len(data)


class _Handler(WSGIRequestHandler):
    """One request per connection, read under the server's deadline and size limit."""

    error_content_type = "text/plain"
    error_message_format = "%(code)d %(message)s: %(explain)s\n"
    server: _Server

    def setup(self) -> None:
        self.connection = self.request
        self.connection.settimeout(self.server.head_timeout_s)
        deadline = time.monotonic() + self.server.head_timeout_s
        if self.server.ssl_context is not None:
            # Handshake here, on this connection's thread, so a slow client never stalls the accept loop.
            self.connection = self.server.ssl_context.wrap_socket(self.connection, server_side=True)
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline, self.server.max_request_bytes))
        self.wfile = _SocketWriter(self.connection)

    def handle(self) -> None:
        try:
            self.raw_requestline = self.rfile.readline(self.server.max_request_bytes + 1)
            if not self.raw_requestline or not self.parse_request():
                return  # client went away, or parse_request already answered 400/414/431
        except _RequestTooLarge:
            self.request_version, self.command, self.requestline = "HTTP/1.0", "", ""
            self.send_error(431, None, f"request head over the limit of {self.server.max_request_bytes} bytes")
            return
        self.connection.settimeout(WRITE_TIMEOUT_S)
        handler = ServerHandler(self.rfile, self.wfile, self.get_stderr(), self.get_environ(), multithread=True)
        handler.request_handler = self
        handler.run(self.server.get_app())

    def get_environ(self) -> dict:
        environ = super().get_environ()
        # wsgiref joins repeated headers with commas; the auth rule must see each one.
        environ[AUTH_KEY] = self.headers.get_all("Authorization") or []
        return environ

    def finish(self) -> None:
        super().finish()
        if self.connection is not self.request:
            self.connection.close()  # the TLS wrapper owns the file descriptor now

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], ssl_context: ssl.SSLContext | None, limits: dict):
        self.ssl_context = ssl_context
        self.head_timeout_s = limits["head_timeout_s"]
        self.max_request_bytes = limits["max_request_bytes"]
        self.max_connections = limits["max_connections"]
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        """Answers 503 without blocking the accept loop (plaintext only: TLS would need a handshake)."""
        try:
            if self.ssl_context is None:
                request.setblocking(False)
                request.send(
                    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
                    + f"over the limit of {self.max_connections} concurrent connections; retry\n".encode()
                )
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        # Timeouts, resets and failed TLS handshakes are the client's business; never a traceback on stderr.
        log.debug("metrics connection from %s failed", client_address, exc_info=True)


class MetricsServer:
    """Serves a registry on `http(s)://host:port/metrics` (and `/healthz`) until `stop()`.

    Args:
        token: when set, /metrics needs `Authorization: Bearer <token>` (rule: `rlep.common.auth.check_bearer`).
        ssl_context: when set, every connection is TLS (`rlep.common.tls.server_ssl_context`).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        *,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ):
        metrics_app = make_wsgi_app(registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if path == "/healthz":
                start_response("200 OK", [("Content-Type", "text/plain")])
                return [b"ok\n"]
            if path != "/metrics":
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found: try /metrics\n"]
            refusal = check_bearer(environ[AUTH_KEY], token) if token else None
            if refusal is not None:
                start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
                return [f"{refusal}\n".encode()]
            return metrics_app(environ, start_response)

        limits = {
            "head_timeout_s": head_timeout_s,
            "max_connections": max_connections,
            "max_request_bytes": max_request_bytes,
        }
        self._server = _Server((host, port), ssl_context, limits)
        self._server.set_app(app)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
