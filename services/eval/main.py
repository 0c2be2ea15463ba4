"""Eval entry point: config -> Redis job store, rollout / verifier clients, job runner -> HTTP server.

The REST app (FastAPI) runs on the bounded HTTP server every HTTP port of RLEP shares (rlep_common/http_server.py),
through a2wsgi: the same connection, head, body and time bounds as /metrics, not a copy of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from a2wsgi import ASGIMiddleware

from rlep.common.http_server import BoundedHttpServer, one_authorization_header
from rlep.common.lifecycle import serve_until_signal
from rlep.common.metrics import service_registry
from rlep.common.tls import server_ssl_context
from rlep.services.eval.config import EvalConfig
from rlep.services.eval.runner import Backends, JobRunner
from rlep.services.eval.server import EvalMetrics, create_app
from rlep.services.eval.store import JobStore
from rlep.services.rollout.client import RolloutClient
from rlep.services.verifier.client import VerifierClient

log = logging.getLogger(__name__)


@dataclass
class RunningEval:
    """A started service; `stop()` requeues the running job, then stops the HTTP server and the clients."""

    http: BoundedHttpServer
    host: str
    port: int
    scheme: str  # "https" when the port serves TLS
    store: JobStore
    runner: JobRunner
    backends: Backends

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def stop(self, grace_s: float = 5.0) -> None:
        self.runner.stop(grace_s)
        self.http.stop()
        for client in (self.backends.rollout, self.backends.checkpoint_rollout, self.backends.verifier):
            if client is not None:
                client.close()
        self.store.close()


def build_backends(config: EvalConfig) -> Backends:
    def rollout_client(endpoints) -> RolloutClient:
        options = {"token": endpoints.read_auth_token(), "timeout_s": endpoints.timeout_s}
        if endpoints.service:
            return RolloutClient.from_service(endpoints.service, **options)  # resolved again before every job
        return RolloutClient(endpoints.names(), **options)

    return Backends(
        rollout=rollout_client(config.rollout),
        checkpoint_rollout=rollout_client(config.checkpoint_rollout) if config.checkpoint_rollout else None,
        verifier=VerifierClient(
            config.verifier.address, token=config.verifier.read_auth_token(), timeout_s=config.verifier.timeout_s
        ),
    )


def start_eval(config: EvalConfig) -> RunningEval:
    store = JobStore.from_url(config.redis_url, config.key_prefix, config.redis_timeout_s)
    store.ping()  # fail at start-up, not on the first request, when Redis is unreachable
    registry = service_registry("eval")
    metrics = EvalMetrics(registry, store)
    backends = build_backends(config)
    runner = JobRunner(
        store,
        backends,
        config,
        on_questions=metrics.questions.inc,
        on_job_end=lambda status, seconds: metrics.job_seconds.labels(status.value).observe(seconds),
    )
    runner.reap_dead_jobs()
    app = create_app(config, store, metrics, registry, runner.wake)
    tls = server_ssl_context(config.server)
    http = BoundedHttpServer(
        one_authorization_header(ASGIMiddleware(app)),
        config.server.host,
        config.server.port,
        tls,
        name="eval-http",
        max_body_bytes=config.server.max_request_bytes,
        json_errors=True,
    )
    runner.start()
    scheme = "https" if tls else "http"
    return RunningEval(http, config.server.host, http.port, scheme, store, runner, backends)


def serve_forever(config: EvalConfig) -> None:
    """Runs until SIGINT/SIGTERM; a job running then is requeued and starts over at the next start."""
    running = start_eval(config)
    log.info("eval listening on %s", running.url)
    checkpoints = "off" if config.checkpoint_rollout is None else ",".join(config.checkpoint_rollout.names())
    serve_until_signal(
        running,
        f"eval listening on {running.url} rollout={','.join(config.rollout.names())}"
        f" checkpoint_rollout={checkpoints} verifier={config.verifier.address}",
    )
