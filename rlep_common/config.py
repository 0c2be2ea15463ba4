"""Config plumbing shared by every service: strict pydantic models and layered loading.

Precedence, lowest first: model defaults < YAML file < environment (`RLEP_<NAME>__a__b=value`,
for Kubernetes) < command-line overrides (dotted paths, e.g. `server.port=50061`).
Values from the environment and the command line are parsed as YAML scalars ("3" -> 3).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class StrictModel(BaseModel):
    """Base of every config: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, validate_default=True)


class ServerConfig(StrictModel):
    """How a service listens. Shared by every gRPC service."""

    host: str = "127.0.0.1"
    """Address to bind. The default keeps the service on loopback; containers use 0.0.0.0."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (printed at start-up)."""
    auth_token_file: Path | None = None
    """File holding a bearer token. When set, every RPC and /metrics must present it."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Port of the Prometheus /metrics endpoint (same host); None disables it, 0 picks a free one."""
    max_request_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """Largest request accepted; larger ones get INVALID_ARGUMENT."""
    grpc_threads: int = Field(16, ge=1, le=1024)
    """Threads handling RPCs concurrently."""

    @model_validator(mode="after")
    def _token_file_exists(self) -> ServerConfig:
        if self.auth_token_file is not None and not self.auth_token_file.is_file():
            raise ValueError(f"auth_token_file {self.auth_token_file} does not exist")
        return self

    def read_auth_token(self) -> str | None:
        if self.auth_token_file is None:
            return None
        token = self.auth_token_file.read_text().strip()
        if not token:
            raise ValueError(f"auth_token_file {self.auth_token_file} is empty")
        return token


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"cannot set {dotted!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`"a.b=3"` -> `("a.b", 3)`; the value is read as a YAML scalar."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def env_overrides(prefix: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Reads `RLEP_<PREFIX>__SECTION__FIELD=value` variables into dotted overrides."""
    environ = dict(os.environ) if environ is None else environ
    head = f"RLEP_{prefix.upper()}__"
    return {
        key[len(head) :].lower().replace("__", "."): yaml.safe_load(value)
        for key, value in environ.items()
        if key.startswith(head)
    }


def load_config(
    cls: type[ConfigT],
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    env_prefix: str | None = None,
    environ: dict[str, str] | None = None,
) -> ConfigT:
    """Builds a config of type `cls` from defaults, a YAML file, the environment and overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        data = loaded or {}
    layers = [env_overrides(env_prefix, environ) if env_prefix else {}, overrides or {}]
    for layer in layers:
        for dotted, value in layer.items():
            _set_dotted(data, dotted, value)
    return cls.model_validate(data)
