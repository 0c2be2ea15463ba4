"""Limits of the Python sandbox that runs a policy's tool calls (issue 50): what one call may use, and how many run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlep.common.config import ServerConfig, StrictModel

# Interpreters the sandbox may run, in order: outside any home folder, so the unprivileged user it runs as can
# reach them. Debian's and the official python images' places.
DEFAULT_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


class SandboxConfig(StrictModel):
    """One call: CPU, wall time, memory, processes, file and output sizes; the service: concurrency and cache."""

    isolation: Literal["bubblewrap", "rlimits"] = "bubblewrap"
    """`bubblewrap` (Debian `bubblewrap`): new user, PID, network, IPC, UTS and mount namespaces; only the
    interpreter's folders visible, read-only; no network at all; a size-bounded tmpfs as the working directory.
    `rlimits`: resource limits and an unprivileged user only. It does NOT stop network access or reading files the
    user may read; only for a host where namespaces are refused, and it says so in every result."""
    python: Path | None = None
    """The interpreter tool code runs under; default: the first of /usr/bin/python3, /usr/local/bin/python3.
    Its folder is mounted read-only in the sandbox, so it must be readable by the unprivileged user."""
    run_as_uid: int = Field(60000, ge=1, le=65000)
    """First of the host users tool code runs as when the service runs as root: concurrent slot k runs as
    `run_as_uid + k` (no account needed; the process-count limit counts per user, and root is exempt from it, so
    root never runs tool code). A service that is not root runs tool code as its own user."""
    cpu_seconds: int = Field(5, ge=1, le=600)
    """CPU time of one call (all its processes), then SIGXCPU/SIGKILL."""
    wall_seconds: float = Field(10.0, gt=0, le=600)
    """Wall time of one call (a sleep or a blocked read uses no CPU), then the whole process tree is killed."""
    memory_mb: int = Field(512, ge=64, le=65536)
    """Address space of each process (RLIMIT_AS): a larger allocation raises MemoryError in the tool code."""
    max_processes: int = Field(16, ge=1, le=4096)
    """Processes and threads of the sandbox user at once (RLIMIT_NPROC): a fork bomb stops here."""
    max_file_bytes: int = Field(1 << 20, ge=1024)
    """Largest file a call may write, its stdout and stderr included (RLIMIT_FSIZE): past it, SIGXFSZ."""
    work_dir_bytes: int = Field(16 << 20, ge=1 << 20)
    """Size of the tmpfs working directory (and /tmp) of one call (`bubblewrap` only)."""
    max_output_bytes: int = Field(16 << 10, ge=64)
    """stdout and stderr a result carries, each; the rest is cut and the result says `truncated`."""
    max_code_bytes: int = Field(64 << 10, ge=64)
    """Largest code a call may send (UTF-8 bytes); larger is refused before anything runs."""
    concurrency: int = Field(2, ge=1, le=256)
    """Calls running at once (each is one process tree)."""
    per_caller: int = Field(1, ge=1)
    """Calls of one caller running at once: a caller with many queued calls leaves slots to the others."""
    cache_entries: int = Field(4096, ge=0)
    """Results kept, keyed by a hash of the code and these limits (0: no cache). Calls that ran out of
    wall time are not cached (that depends on the machine's load)."""

    @model_validator(mode="after")
    def _fits(self) -> SandboxConfig:
        if self.per_caller > self.concurrency:
            raise ValueError(f"per_caller ({self.per_caller}) cannot exceed concurrency ({self.concurrency})")
        if self.max_output_bytes > self.max_file_bytes:
            raise ValueError("max_output_bytes cannot exceed max_file_bytes (stdout is a file of the call)")
        return self

    def environment(self) -> dict:
        """What a call's output depends on, as JSON-able data: the isolation and limits, and the interpreter,
        resolved (/usr/bin/python3 -> python3.11). Not the scheduling (concurrency, the cache, the host user)."""
        scheduling = {"concurrency", "per_caller", "cache_entries", "run_as_uid", "python"}
        return {**self.model_dump(mode="json", exclude=scheduling), "python": str(self.interpreter())}

    def interpreter(self) -> Path:
        """The interpreter to run, checked to exist (ValueError naming the setting otherwise)."""
        candidates = [self.python] if self.python else [Path(p) for p in DEFAULT_PYTHONS]
        for path in candidates:
            if path.is_file():
                return path.resolve()
        raise ValueError(f"sandbox.python: no interpreter at {', '.join(map(str, candidates))}; set sandbox.python")

    def prlimit(self) -> str:
        """The `prlimit` executable (util-linux, on every Debian), which sets the limits (ValueError when missing)."""
        found = shutil.which("prlimit")
        if found is None:
            raise ValueError("the sandbox needs `prlimit` (Debian/Ubuntu: util-linux) to set its resource limits")
        return found

    def setpriv(self) -> str:
        """The `setpriv` executable (util-linux), which runs a call as its unprivileged user (ValueError when
        missing)."""
        found = shutil.which("setpriv")
        if found is None:
            raise ValueError("the sandbox needs `setpriv` (Debian/Ubuntu: util-linux) to run code as its own user")
        return found

    def bubblewrap(self) -> str:
        """The `bwrap` executable (ValueError with the fix when it is missing)."""
        found = shutil.which("bwrap")
        if found is None:
            raise ValueError(
                "sandbox.isolation=bubblewrap needs `bwrap` (Debian/Ubuntu: apt-get install bubblewrap); "
                "isolation=rlimits runs without it but does not stop network access or file reads"
            )
        return found


DEFAULT_PORT = 50064


class SandboxServiceConfig(StrictModel):
    """`rlep serve sandbox`: the sandbox behind gRPC (`rlep.sandbox.v1.Sandbox`), for learners that do not run tool
    code in their own process (`endpoints.sandbox`), e.g. a pod of its own on Kubernetes."""

    server: ServerConfig = ServerConfig(port=DEFAULT_PORT, max_request_bytes=1 << 20)
    """A request is one piece of code (at most `sandbox.max_code_bytes`): 1 MiB bounds what a caller can send."""
    sandbox: SandboxConfig = SandboxConfig()
    max_calls_in_flight: int | None = Field(None, ge=1)
    """Run calls in the server at once, running or waiting for a slot; one more gets UNAVAILABLE at once. Each holds a
    gRPC thread. None = `server.grpc_threads` - 2 (two threads always free for health checks)."""
    max_wait_s: float = Field(60.0, gt=0)
    """Longest a call waits for a slot (a shorter client deadline ends it sooner): DEADLINE_EXCEEDED after it."""

    @property
    def call_slots(self) -> int:
        return self.server.call_slots(self.max_calls_in_flight)

    @model_validator(mode="after")
    def _calls_leave_threads(self) -> SandboxServiceConfig:
        self.server.call_slots(self.max_calls_in_flight)  # ValueError when no thread is left for health checks
        if self.sandbox.max_code_bytes > self.server.max_request_bytes:
            raise ValueError("sandbox.max_code_bytes cannot exceed server.max_request_bytes")
        return self
