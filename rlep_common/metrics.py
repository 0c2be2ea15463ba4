"""Prometheus endpoint shared by every service: `/metrics` (optionally behind a bearer token) and `/healthz`.

Each service owns a `CollectorRegistry` (no global state, so several services can live in one
process, as in tests) and serves it from a background thread.
"""

from __future__ import annotations

import hmac
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


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
