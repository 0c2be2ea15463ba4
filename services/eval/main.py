"""Eval entry point: config -> Redis job store, rollout / verifier clients, job runner -> HTTP server.

Without `redis_url` the service starts its own redis-server (password, AOF under `local_redis_dir`), supervised as
replay's is (rlep_common/redis_supervisor.py): restarted when it dies; when it cannot be, /healthz answers 503 and
`rlep serve eval` exits with status 3 for its supervisor to start it again.

The REST app (FastAPI) runs on the bounded HTTP server every HTTP port of RLEP shares (rlep_common/http_server.py),
through a2wsgi: the same connection, head, body and time bounds as /metrics, not a copy of them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from a2wsgi import ASGIMiddleware

from rlep.common.config import redact_secrets
from rlep.common.http_server import BoundedHttpServer, one_authorization_header
from rlep.common.lifecycle import stop_on_signal
from rlep.common.metrics import service_registry
from rlep.common.redis_server import LocalRedis, start_local_redis
from rlep.common.redis_supervisor import RedisSupervisor
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
    redis_supervisor: RedisSupervisor | None = field(default=None)  # a self-started Redis, kept alive

    @property
    def failure(self) -> str | None:
        """What broke the service for good (its self-started Redis could not be restarted), or None."""
        return self.redis_supervisor.lost if self.redis_supervisor else None

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
        if self.redis_supervisor:
            self.redis_supervisor.stop()


def build_backends(config: EvalConfig) -> Backends:
    def rollout_client(endpoints) -> RolloutClient:
        options = {
            "token": endpoints.read_auth_token(),
            "timeout_s": endpoints.timeout_s,
            "generate_deadline": endpoints.generate_deadline,
        }
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


EMBEDDED_REDIS_LOST_EXIT_CODE = 3


def start_eval(config: EvalConfig, on_failure: Callable[[str], None] | None = None) -> RunningEval:
    """Starts the service. `on_failure(reason)` runs when its self-started Redis is lost for good (after /healthz
    turned 503)."""
    local = None if config.redis_url else start_local_redis(config.local_redis_dir)
    try:
        return _start_on(config, local.url if local else config.redis_url, local, on_failure)
    except BaseException:
        if local:
            local.stop()
        raise


def _start_on(
    config: EvalConfig, redis_url: str, local: LocalRedis | None, on_failure: Callable[[str], None] | None
) -> RunningEval:
    store = JobStore.from_url(redis_url, config.key_prefix, config.redis_timeout_s)
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
    running: RunningEval | None = None
    app = create_app(config, store, metrics, registry, runner.wake, failure=lambda: running and running.failure)
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
    running = RunningEval(http, config.server.host, http.port, scheme, store, runner, backends)
    if local:  # once it is lost for good, /healthz answers 503 (`failure`), then `on_failure` runs
        running.redis_supervisor = RedisSupervisor(local, on_failure or (lambda reason: None))
    return running


def serve_forever(config: EvalConfig) -> None:
    """Runs until SIGINT/SIGTERM (exit 0; a job running then is requeued and starts over at the next start) or until
    its self-started Redis is lost for good (exit 3)."""
    stop = stop_on_signal()
    lost: list[str] = []
    running = start_eval(config, on_failure=lambda reason: (lost.append(reason), stop.set()))
    log.info("eval listening on %s", running.url)
    checkpoints = "off" if config.checkpoint_rollout is None else ",".join(config.checkpoint_rollout.names())
    # The embedded Redis's URL carries its password: the banner shows where it is, never the secret.
    where = redact_secrets(running.redis_supervisor.server.url) if running.redis_supervisor else "configured Redis"
    print(
        f"eval listening on {running.url} rollout={','.join(config.rollout.names())}"
        f" checkpoint_rollout={checkpoints} verifier={config.verifier.address} redis={where}",
        flush=True,
    )
    stop.wait()
    running.stop()
    sys.exit(EMBEDDED_REDIS_LOST_EXIT_CODE if lost else 0)
