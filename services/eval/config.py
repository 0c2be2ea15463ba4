"""Configuration of the evaluation service: where it listens, which services it drives, and job limits.

The service talks to two rollout deployments. `rollout` is the policy being trained (what
`model: "current"` evaluates, read-only). `checkpoint_rollout` belongs to eval alone: evaluating a
checkpoint pushes its weights there as a new policy version, so it must not be the deployment the
learner trains with (its policy would be replaced). Without `checkpoint_rollout`, checkpoint
evaluations are refused.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from rlep.common.config import StrictModel, TlsFiles
from rlep.common.files import read_token_file
from rlep.services.rollout.config import SERVICE_PATTERN, GenerateDeadline

DEFAULT_PORT = 8080
DEFAULT_ROLLOUT_ADDRESS = "127.0.0.1:50063"  # `rlep serve rollout` on this host


class _WithTokenFile(StrictModel):
    auth_token_file: Path | None = None
    """File holding a bearer token (one line)."""

    @model_validator(mode="after")
    def _token_file_exists(self) -> _WithTokenFile:
        if self.auth_token_file is not None and not self.auth_token_file.is_file():
            raise ValueError(f"auth_token_file {self.auth_token_file} does not exist")
        return self

    def read_auth_token(self) -> str | None:
        return read_token_file(self.auth_token_file)


class HttpServerConfig(_WithTokenFile, TlsFiles):
    """How the REST API listens. With `auth_token_file`, everything but /healthz and the API docs
    (/openapi.json, /docs) needs `Authorization: Bearer <token>`, /metrics included. With `tls_cert_file` and
    `tls_key_file`, the port speaks HTTPS only."""

    host: str = "127.0.0.1"
    """Address to bind. The default keeps the service on loopback; containers use 0.0.0.0."""
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    """HTTP port; 0 picks a free one (printed at start-up)."""
    max_request_bytes: int = Field(1 << 20, gt=0)
    """Larger request bodies get 413."""


class RolloutEndpoints(_WithTokenFile):
    """Replicas of a rollout deployment (gRPC addresses) and the token they require."""

    addresses: list[str] | None = Field(None, min_length=1)
    """host:port of every replica; a batch is spread over all of them. None: `service`, else 127.0.0.1:50063."""
    service: str | None = Field(None, pattern=SERVICE_PATTERN)
    """Or `NAME:PORT`: a DNS name resolving to every replica's IP (Kubernetes: a headless Service), resolved
    again before every job (services/rollout/discovery.py). Set this or `addresses`."""
    timeout_s: float = Field(1800.0, gt=0)
    """Deadline of one weight push (a checkpoint evaluation's)."""
    generate_deadline: GenerateDeadline = GenerateDeadline(floor_s=1800.0)
    """Deadline of one Generate call (one chunk of questions), from its size: 1,800 s (a call may queue behind
    the learner's on a deployment they share) + 0.2 s per thousand tokens the call may sample (docs/scaling.md,
    *Generate deadline*)."""

    @model_validator(mode="after")
    def _one_source(self) -> RolloutEndpoints:
        if self.addresses is not None and self.service is not None:
            raise ValueError("a rollout deployment is named by its replicas' `addresses` or a `service`, not both")
        return self

    def names(self) -> list[str]:
        """How the replicas are named: the service, or their addresses."""
        return [self.service] if self.service else list(self.addresses or [DEFAULT_ROLLOUT_ADDRESS])


class VerifierEndpoint(_WithTokenFile):
    address: str = "127.0.0.1:50061"
    """host:port of the verifier service."""
    timeout_s: float = Field(600.0, gt=0)
    """Deadline of one Verify call."""


class EvalLimits(StrictModel):
    """Bounds on one job, checked when it is submitted (over them: 422 with the limit named)."""

    max_n: int = Field(256, ge=1)
    """Samples per question."""
    max_questions: int = Field(5000, ge=1)
    """Questions per job, summed over its datasets."""
    max_samples: int = Field(1_000_000, ge=1)
    """Questions x n per job."""
    max_tokens: int = Field(32768, ge=1)
    """Largest `max_tokens` (new tokens per sample)."""
    max_job_tokens: int = Field(100_000_000, ge=1)
    """Questions x n x max_tokens per job: the most new tokens one job may ask of the rollout deployment, which it
    shares with training (1e8 is about 1.4 h of a GPU replica at 20k tokens/s)."""
    max_datasets: int = Field(16, ge=1)
    """Datasets per job."""
    max_queued_jobs: int = Field(100, ge=1)
    """Jobs waiting to run; a submission beyond gets 429."""


class EvalConfig(StrictModel):
    server: HttpServerConfig = HttpServerConfig()
    """Where the REST API listens."""
    redis_url: str | None = None
    """Redis holding jobs and results (they survive a restart of the service), e.g. redis://:password@host:6379/0.
    None starts a local redis-server with a password and an AOF under `local_redis_dir`, restarted when it dies
    (as replay's): never another program's Redis by accident."""
    local_redis_dir: Path = Path.home() / ".cache" / "rlep" / "eval-redis"
    """Data directory (AOF, password file) of the self-started redis-server."""
    key_prefix: str = Field("rlep:eval:", min_length=1)
    """Prefix of every Redis key of this service (several deployments can share one Redis)."""
    rollout: RolloutEndpoints = RolloutEndpoints()
    """The policy deployment: `model: "current"` samples from it as it is, never pushing weights."""
    checkpoint_rollout: RolloutEndpoints | None = None
    """Eval's own rollout deployment: a checkpoint's weights are pushed here before sampling. None: checkpoint
    evaluations are refused. Must not be a deployment the learner trains with."""
    verifier: VerifierEndpoint = VerifierEndpoint()
    """Scores every response."""
    limits: EvalLimits = EvalLimits()
    """Bounds on one job."""
    allowed_roots: list[Path] = Field(default_factory=lambda: [Path.cwd()])
    """Directories that user dataset files and checkpoints must lie under (default: the service's working
    directory; [] allows the built-in sets only). A path elsewhere gets the same answer as a missing one, so a
    request cannot probe which files exist on the server."""
    questions_per_call: int = Field(32, ge=1, le=4096)
    """Questions per Generate call. Progress, metrics and cancellation advance at this granularity."""
    max_stored_samples: int = Field(100_000, ge=0)
    """Responses kept per job for GET /v1/evaluations/{id}/samples and `rlep eval --samples` (texts up to 16 KiB
    each, a question's prompt and answer once per job; they stay in Redis as long as the job). Past it they are
    counted in the job's `samples_dropped`, not stored; 0 keeps none."""
    max_sample_page_bytes: int = Field(4 << 20, ge=1 << 20, le=64 << 20)
    """Most bytes of JSON in one page of GET /v1/evaluations/{id}/samples: a page stops before the sample that would
    pass it (`cut_at_bytes`, `next_offset`), so concurrent readers cost bounded memory and time. At least 1 MiB, so
    the largest sample (four 16 KiB texts, each up to 6x as JSON escapes) always fits."""
    lease_s: float = Field(30.0, ge=1.0, le=3600)
    """A running job whose service sends no heartbeat for this long is marked failed (its service died)."""
    redis_timeout_s: float = Field(10.0, gt=0)
    """Socket timeout of Redis calls; past it an API call gets 503."""
    tensorboard_dir: Path | None = None
    """Where each succeeded job's figures go as TensorBoard event files, one folder per job (`<dir>/<job id>`):
    `<dataset>/avg@N`, `maj@N`, `pass@N`, `mean_response_tokens` at the policy version sampled (eval/tracking.py).
    None = none written (the figures are in the job's REST answer either way)."""

    @model_validator(mode="after")
    def _checkpoint_rollout_is_separate(self) -> EvalConfig:
        shared = set(self.rollout.names()) & set(self.checkpoint_rollout.names() if self.checkpoint_rollout else [])
        if shared:
            raise ValueError(
                f"checkpoint_rollout shares {sorted(shared)} with rollout: evaluating a checkpoint would replace the "
                "policy being trained; give eval its own rollout deployment"
            )
        return self
