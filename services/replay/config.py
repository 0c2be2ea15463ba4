"""Configuration of the replay service."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from rlep_common.config import ServerConfig, StrictModel
from services.replay.core import Eviction

DEFAULT_PORT = 50062


class ReplayConfig(StrictModel):
    server: ServerConfig = ServerConfig(port=DEFAULT_PORT)
    """Where the gRPC server listens."""
    redis_url: str | None = None
    """Redis to use, e.g. redis://:password@host:6379/0. None starts a local redis-server (embedded default)."""
    local_redis_dir: Path = Path.home() / ".cache" / "rlep" / "redis"
    """Data directory (AOF) of the self-started redis-server."""
    local_redis_appendfsync: Literal["always", "everysec"] = "always"
    """fsync policy of the self-started server: `always` loses no acknowledged add on a crash."""
    capacity_per_question: int = Field(64, ge=1, le=100_000)
    """Successes kept per question; adding beyond evicts one (see `eviction`). Applies to new pools."""
    eviction: Eviction = Eviction.OLDEST
    """Which success a full question drops: the oldest, or the one with the lowest priority."""
    max_m: int = Field(256, ge=1)
    """Largest M accepted by Sample."""
    max_questions_per_sample: int = Field(65_536, ge=1)
    """Largest number of question ids in one Sample call."""
    max_trajectory_bytes: int = Field(1 << 20, ge=1024)
    """Serialized trajectories above this are rejected (reason "oversize")."""
    max_trajectories_per_add: int = Field(20_000, ge=1)
    """Largest number of trajectories in one AddTrajectories call (ImportPool chunks alike)."""
    redis_timeout_s: float = Field(10.0, gt=0)
    """Socket timeout of Redis calls; past it the RPC fails with UNAVAILABLE (retriable)."""
