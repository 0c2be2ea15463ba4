"""What one sandboxed call answers (`ToolResult`): plain data, shared by the sandbox and the code that calls it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal[
    "ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed", "sandbox_failure", "refused"
]
"""`refused`: never run, the code is no text the sandbox takes (over `max_code_bytes`, a NUL, not UTF-8); the
sandbox itself raises ValueError for it, and a caller that must answer every call (the tool loop) says so."""


@dataclass(frozen=True)
class ToolResult:
    """What one call did. `status` is one of `Status`; `detail` says why in one line for anything but `ok`."""

    status: Status
    exit_code: int | None
    """The interpreter's exit status; None when it was killed by a signal (see `signal`)."""
    signal: int | None
    stdout: str
    stderr: str
    truncated: bool
    """stdout or stderr was longer than `max_output_bytes` and was cut."""
    duration_s: float
    isolation: str
    detail: str = ""
    cached: bool = False
