"""Prometheus endpoint shared by every service: `/metrics` (optionally behind a bearer token, optionally TLS)
and `/healthz`; and `MetricFactory`, how a service declares its series.

Each service owns a `CollectorRegistry` (no global state, so several services can live in one
process, as in tests) and serves it from a background thread, on the bounded HTTP server every HTTP port
shares (rlep_common/http_server.py: connections, head size and time, one request per connection).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from rlep.common.auth import check_bearer
from rlep.common.http_server import AUTH_KEY, BoundedHttpServer

log = logging.getLogger(__name__)


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
        **limits,
    ):
        """`limits`: the HTTP server's bounds (`BoundedHttpServer`'s head_timeout_s, max_connections, ...)."""
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

        self._http = BoundedHttpServer(app, host, port, ssl_context, name="metrics", **limits)
        self.port = self._http.port

    def stop(self) -> None:
        self._http.stop()
