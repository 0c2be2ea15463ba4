"""Prometheus endpoint shared by every service: `/metrics` (optionally behind a bearer token) and `/healthz`.

Each service owns a `CollectorRegistry` (no global state, so several services can live in one
process, as in tests) and serves it from a background thread.
"""

from __future__ import annotations

import hmac
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample


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


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass


class _ThreadingWSGIServer(WSGIServer):
    daemon_threads = True


class MetricsServer:
    """Serves a registry on `http://host:port/metrics` until `stop()`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, token: str | None = None):
        metrics_app = make_wsgi_app(registry)
        expected = f"Bearer {token}".encode() if token else None

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if path == "/healthz":
                start_response("200 OK", [("Content-Type", "text/plain")])
                return [b"ok\n"]
            if path != "/metrics":
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found: try /metrics\n"]
            presented = environ.get("HTTP_AUTHORIZATION", "").encode()
            if expected is not None and not hmac.compare_digest(presented, expected):
                start_response("401 Unauthorized", [("Content-Type", "text/plain")])
                return [b"missing or wrong bearer token\n"]
            return metrics_app(environ, start_response)

        self._server = make_server(host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
