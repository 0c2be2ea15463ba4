"""Config plumbing shared by every service: strict pydantic models and layered loading.

`load_config` is how every command and service builds its config. Precedence, lowest first: model
defaults < YAML file < environment (`RLEP_<NAME>__a__b=value`, for Kubernetes) < command-line
overrides (`--set` dotted paths, e.g. `server.port=50061`, then named flags).
Values from the environment and the command line are parsed as YAML scalars ("3" -> 3).
A section that any layer sets only in part keeps its model default for the rest: replay's
`server` defaults to port 50062, so `server.host=0.0.0.0` leaves the port at 50062.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlep.common.files import read_token_file
from rlep.common.redaction import redact_url

# The default configs and the paper's recipes: `configs/` in a checkout, package data (`rlep.configs`) when installed.
CONFIG_DIR = Path(importlib.util.find_spec("rlep.configs").submodule_search_locations[0])


class StrictModel(BaseModel):
    """Base of every config: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, validate_default=True)


class TlsFiles(StrictModel):
    """A listener's optional TLS certificate and key (PEM files, e.g. mounted from a Kubernetes Secret).

    Shared by the gRPC services' `ServerConfig` and any HTTP listener (eval): both or neither.
    """

    tls_cert_file: Path | None = None
    """PEM certificate chain. With `tls_key_file`, the port serves TLS only (plaintext clients are refused)."""
    tls_key_file: Path | None = None
    """PEM private key of `tls_cert_file`; set both or neither."""

    @model_validator(mode="after")
    def _tls_pair(self) -> TlsFiles:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both (TLS) or neither (plaintext)")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name} {path} does not exist")
        return self

    def read_tls_pair(self) -> tuple[bytes, bytes] | None:
        """`(certificate_chain_pem, private_key_pem)`, or None when TLS is off."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return self.tls_cert_file.read_bytes(), self.tls_key_file.read_bytes()


class ServerConfig(TlsFiles):
    """How a service listens. Shared by every gRPC service; TLS (when set) covers the gRPC port and /metrics."""

    host: str = "127.0.0.1"
    """Address to bind. The default keeps the service on loopback; containers use 0.0.0.0."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (printed at start-up)."""
    auth_token_file: Path | None = None
    """File holding a bearer token. When set, every RPC and /metrics must present it."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Port of the Prometheus /metrics endpoint (same host); None disables it, 0 picks a free one."""
    health_port: int | None = Field(None, ge=0, le=65535)
    """Port of a second, plaintext gRPC server (same host) answering only the standard health check, with what the
    data port's own health check last said (rlep_common/health_port.py). Probes there answer at once when the data
    port's calls keep its health check waiting, and the kubelet's gRPC probe (no TLS) works with TLS on. None
    disables it, 0 picks a free one (printed at start-up)."""
    health_stall_s: float = Field(30.0, gt=0, le=3600)
    """The health port says NOT_SERVING when the data port's health check has not answered this long."""
    max_request_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """Largest request accepted; larger ones get INVALID_ARGUMENT."""
    grpc_threads: int = Field(16, ge=2, le=1024)
    """Threads handling RPCs concurrently."""
    max_inflight_request_bytes: int | None = Field(None, gt=0)
    """Request bytes (serialized) the calls being handled may hold at once; a call that would pass it gets
    RESOURCE_EXHAUSTED (retryable), so large messages cannot take the memory and threads health and small calls
    need (rlep_common/grpc_interceptors.py). A call is admitted whatever its size when nothing is held.
    None = twice `max_request_bytes` (128 MiB by default)."""
    max_streams_per_method: int | None = Field(None, ge=1)
    """Streams (ImportPool, UpdateWeights, ExportPool) of one method served at once; more get RESOURCE_EXHAUSTED,
    so streams never take the threads the health check and other calls need (rlep_common/stream_guard.py).
    None = a quarter of `grpc_threads` (4 of 16)."""
    stream_idle_timeout_s: float = Field(30.0, gt=0, le=3600)
    """A stream stalled on its client this long is cancelled: the server waits for a message the client does not
    send (a message that carries nothing does not count), or cannot write a response the client does not read."""
    stream_max_duration_s: float = Field(4 * 3600.0, gt=0)
    """A stream open this long is cancelled however it behaves (one trickling just under the idle timeout too).
    Generous: a full pool export or a large weight push takes minutes."""

    @property
    def inflight_request_bytes(self) -> int:
        return self.max_inflight_request_bytes or 2 * self.max_request_bytes

    @property
    def stream_slots(self) -> int:
        return self.max_streams_per_method or max(1, self.grpc_threads // 4)

    def call_slots(self, max_calls_in_flight: int | None) -> int:
        """Unary calls a service holds at once, each waiting on a gRPC thread (the verifier's and the sandbox's
        `max_calls_in_flight`): that setting, or `grpc_threads` - 2 when None. ValueError when it leaves the health
        check no thread."""
        slots = max_calls_in_flight or max(1, self.grpc_threads - 2)
        if slots >= self.grpc_threads:
            raise ValueError(
                f"max_calls_in_flight ({slots}) must stay below server.grpc_threads "
                f"({self.grpc_threads}): the health check needs a thread"
            )
        return slots

    @model_validator(mode="after")
    def _streams_leave_threads(self) -> ServerConfig:
        if self.stream_slots >= self.grpc_threads:
            raise ValueError(
                f"max_streams_per_method ({self.stream_slots}) must stay below grpc_threads "
                f"({self.grpc_threads}): streams would take every thread"
            )
        return self

    @model_validator(mode="after")
    def _ports_are_their_own(self) -> ServerConfig:
        # Caught here, before binding: the second bind would fail as "port in use" by this very service.
        named = [("port", self.port), ("metrics_port", self.metrics_port), ("health_port", self.health_port)]
        taken = [(name, port) for name, port in named if port]  # None and 0 (any free port) never collide
        for i, (name, port) in enumerate(taken):
            for other, other_port in taken[i + 1 :]:
                if port == other_port:
                    flag = "--" + other.replace("_", "-")
                    raise ValueError(
                        f"{name} and {other} are the same ({port}): each needs a port of its own; "
                        f"give {flag} another one (0 = any free port)"
                    )
        return self

    @model_validator(mode="after")
    def _token_file_exists(self) -> ServerConfig:
        if self.auth_token_file is not None and not self.auth_token_file.is_file():
            raise ValueError(f"auth_token_file {self.auth_token_file} does not exist")
        return self

    def read_auth_token(self) -> str | None:
        return read_token_file(self.auth_token_file)


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


def env_overrides(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
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
    path: Path | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    env_prefix: str | None = None,
    sets: Sequence[str] | None = None,
    base: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> ConfigT:
    """The one way a command or service builds its config of type `cls`. Layers, lowest first:

    model defaults < `base` (a YAML of defaults kept with the package, e.g. configs/demo.yaml) < `path` (the
    user's YAML file, or the already-parsed mapping a Ray Serve config carries) < environment
    (`RLEP_<ENV_PREFIX>__A__B=value`) < `sets` (`--set a.b=value` texts) < `overrides` (dotted path -> value,
    e.g. a named option; None = not given, so the layers below decide).

    Raises:
        ValueError: a malformed layer or an invalid result (pydantic's ValidationError is a ValueError).
    """
    data: dict[str, Any] = {}
    for layer in (base, path):
        data = deep_merge(data, _read_layer(layer))
    flags = {dotted: value for dotted, value in (overrides or {}).items() if value is not None}
    dotted_layers = [
        env_overrides(env_prefix, environ) if env_prefix else {},
        dict(parse_override(text) for text in sets or ()),
        {dotted: str(value) if isinstance(value, Path) else value for dotted, value in flags.items()},
    ]
    for layer in dotted_layers:
        for dotted, value in layer.items():
            _set_dotted(data, dotted, value)
    return cls.model_validate(_with_section_defaults(cls, data))


def _read_layer(source: Path | Mapping[str, Any] | None) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):  # a copy: the layers above are written into it
        return copy.deepcopy(dict(source))
    loaded = yaml.safe_load(Path(source).read_text())
    if loaded is not None and not isinstance(loaded, dict):
        raise ValueError(f"{source}: top level must be a mapping")
    return loaded or {}


def _with_section_defaults(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """`data` where every section it sets in part is completed from that section's default instance.

    Without this a partial section is validated from the sub-model's *field* defaults, dropping what
    the parent's default instance set (replay's `ServerConfig(port=50062)` came back on port 0).
    A section naming another variant (a different `type`) is left as given: the default's fields
    would not fit it.
    """
    merged = dict(data)
    for name, field in cls.model_fields.items():
        key = field.alias or name
        given, default = merged.get(key), field.default
        if not isinstance(given, dict) or not isinstance(default, BaseModel):
            continue
        if "type" in given and given["type"] != getattr(default, "type", given["type"]):
            continue
        base = default.model_dump(exclude_unset=True)
        merged[key] = _with_section_defaults(type(default), deep_merge(base, given))
    return merged


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`base` with `top` written over it, section by section (a key both set to mappings is merged, not replaced)."""
    out = dict(base)
    for key, value in top.items():
        both_dicts = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if both_dicts else value
    return out


def redact_secrets(value: Any) -> Any:
    """A copy of JSON-like `value` in which every URL's password (user-info or `?password=`) reads `***`."""
    if isinstance(value, dict):
        return {k: redact_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


def dump_config_json(config: BaseModel) -> str:
    """The resolved config as indented JSON with URL passwords masked: what every `--dry-run` prints."""
    return json.dumps(redact_secrets(config.model_dump(mode="json")), indent=2)
