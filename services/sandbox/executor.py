"""Runs untrusted Python (a policy's tool call) in a sandbox, one process tree per call, and says what happened.

Isolation (`SandboxConfig.isolation`):
- `bubblewrap`: `bwrap` with new user, PID, network, IPC, UTS and cgroup namespaces. The sandbox sees /usr (and
  /lib, /lib64) read-only, its own /proc and /dev, and a size-bounded tmpfs as /work and /tmp; nothing else of the
  host: no /etc, no home, no token file, no socket. The network namespace has only a loopback that is down, so no
  address, local or public, is reachable. PID 1 of the namespace is the tool code itself (`--as-pid-1`): when it
  ends or is killed, the kernel kills everything it started, and no process is left for the host to reap.
- `rlimits`: the same resource limits and an unprivileged user, nothing else (network and readable files are
  reachable); for hosts that refuse namespaces, flagged in every result.

Both: `prlimit` sets CPU time, address space, process count, file size and no core dumps before `bwrap` (or the
interpreter) starts, so every process of the call inherits them; the call runs as an unprivileged host user (one
uid per concurrent slot: the process limit counts per user, and root is exempt from it); the environment is
cleared (fixed hash seed, UTC, C.UTF-8); stdout and stderr go to files the size limit bounds; a wall-clock bound
kills the process group. Not stopped: CPU-time side channels between concurrent calls, reading the wall clock,
and kernel exploits (no seccomp filter: `ctypes` can make any system call the namespaces leave harmless).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.types import Status, ToolResult

ENV = {"PYTHONHASHSEED": "0", "TZ": "UTC", "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin", "HOME": "/work"}
# Lines of Python's traceback that say which limit a call hit (its exception is the only sign of some).
MEMORY_SIGNS = ("MemoryError",)
FILE_SIZE_SIGNS = ("[Errno 27] File too large", "OSError: [Errno 27]")
BWRAP_MESSAGE = "bwrap: "
KILL_GRACE_S = 2.0
"""After the code's processes are killed on a timeout, how long bwrap has to reap them and exit."""


def cache_key(code: str, config: SandboxConfig) -> str:
    """The hash a result is cached under: the code and every limit that can change what it does."""
    limits = config.model_dump(mode="json", exclude={"concurrency", "per_caller", "cache_entries"})
    return hashlib.sha256(json.dumps([code, limits], sort_keys=True).encode()).hexdigest()


def limits_command(config: SandboxConfig, prlimit: str) -> list[str]:
    """`prlimit` and its arguments: the resource limits every process of a call inherits."""
    cpu = config.cpu_seconds
    return [
        prlimit,
        f"--cpu={cpu}:{cpu + 1}",  # SIGXCPU at the soft limit, SIGKILL a second later
        f"--as={config.memory_mb << 20}",
        f"--nproc={config.max_processes}",
        f"--fsize={config.max_file_bytes}",
        "--core=0",
        "--",
    ]


def user_command(setpriv: str, user: int) -> list[str]:
    """`setpriv` and its arguments: the call runs as host user and group `user`, with no supplementary groups.

    Not Popen's `user=`/`group=`: with them CPython forks (no vfork), and the fork runs gRPC's fork handlers in the
    child: while other threads of this process were inside gRPC calls (a tool rollout's Generate), the child crashed
    before exec (5 of 300 calls came back `killed`, gRPC's poller errors as their stderr). Without them CPython
    vforks, which runs no fork handler."""
    return [setpriv, f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"]


def bubblewrap_command(config: SandboxConfig, bwrap: str) -> list[str]:
    size = str(config.work_dir_bytes)
    return [
        bwrap,
        "--unshare-all",  # user, pid, net, ipc, uts, cgroup
        "--as-pid-1",  # no bwrap reaper in the namespace: it outlived bwrap as a zombie nobody reaps (PID 1 of a pod)
        "--die-with-parent",
        "--new-session",  # no TIOCSTI into the caller's terminal
        "--ro-bind", "/usr", "/usr",
        "--ro-bind-try", "/lib", "/lib",
        "--ro-bind-try", "/lib64", "/lib64",
        "--ro-bind-try", "/bin", "/bin",
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", size, "--tmpfs", "/work",
        "--size", size, "--tmpfs", "/tmp",
        "--remount-ro", "/",
        "--chdir", "/work",
        "--clearenv",
        *[arg for name, value in ENV.items() for arg in ("--setenv", name, value)],
        "--",
    ]  # fmt: skip


def check_code(code: str, config: SandboxConfig) -> None:
    """ValueError for code no call may run: not UTF-8 text, over `max_code_bytes`, or with a NUL character."""
    try:
        size = len(code.encode("utf-8"))
    except UnicodeEncodeError as err:  # a lone surrogate: not text any interpreter can be given
        raise ValueError(f"code is not valid UTF-8 text ({err.reason} at {err.start})") from None
    if size > config.max_code_bytes:
        raise ValueError(f"code of {size} bytes exceeds sandbox.max_code_bytes ({config.max_code_bytes})")
    if "\x00" in code:
        raise ValueError("code contains a NUL character")


def run_code(code: str, config: SandboxConfig, uid: int | None = None) -> ToolResult:
    """Runs `code` under `config`'s isolation and limits, as host user `uid` (when this process is root; None: the
    config's `run_as_uid`). Never raises for anything the code does; ValueError for code `check_code` refuses."""
    check_code(code, config)
    python = str(config.interpreter())
    command = limits_command(config, config.prlimit())
    if config.isolation == "bubblewrap":
        command += bubblewrap_command(config, config.bubblewrap())
    command += [python, "-s", "-c", code]  # not -I: it would ignore PYTHONHASHSEED (the environment is ours)
    root = os.geteuid() == 0
    user = (config.run_as_uid if uid is None else uid) if root else None
    if user is not None:
        command = user_command(config.setpriv(), user) + command
    own_folder = tempfile.TemporaryDirectory(prefix="rlep-sandbox-") if config.isolation == "rlimits" else None
    with (
        own_folder or contextlib.nullcontext() as work,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        if config.isolation == "bubblewrap":  # bwrap clears the environment and gives the code a tmpfs /work
            env, cwd = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, "/"
        else:  # the code's own folder on the host, writable by its user only
            env, cwd = ENV | {"HOME": work}, work
            if user is not None:
                os.chown(work, user, user)
        started = time.monotonic()
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
        reaped = _Reaper(process)
        timed_out = not reaped.done.wait(config.wall_seconds)
        if timed_out:
            _kill_tree(process, reaped.done)
        duration = time.monotonic() - started
        stdout, cut_out = _read(out, config.max_output_bytes)
        stderr, cut_err = _read(err, config.max_output_bytes)
    exit_code, killed_by = _exit(process.returncode, bubblewrapped=config.isolation == "bubblewrap")
    status, detail = _status(exit_code, killed_by, timed_out, reaped.cpu_seconds, stderr, config)
    if config.isolation == "rlimits":
        detail = (detail + "; " if detail else "") + "isolation=rlimits: network and readable files were reachable"
    return ToolResult(status, exit_code, killed_by, stdout, stderr, cut_out or cut_err, duration, config.isolation,
                      detail)  # fmt: skip


class _Reaper:
    """Waits for the call's process in a thread with `wait4`, which also returns the CPU time of the whole tree
    (each process's reaped children's time is added to it): the only sign of the CPU limit when the code, as PID 1
    of its namespace, never receives SIGXCPU and is SIGKILLed at the hard limit."""

    def __init__(self, process: subprocess.Popen):
        self.done = threading.Event()
        self.cpu_seconds = 0.0
        self._process = process
        threading.Thread(target=self._wait, name=f"sandbox-wait-{process.pid}", daemon=True).start()

    def _wait(self) -> None:
        _, status, usage = os.wait4(self._process.pid, 0)
        self._process.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait for it again
        self.cpu_seconds = usage.ru_utime + usage.ru_stime
        self.done.set()


def _kill_tree(process: subprocess.Popen, exited: threading.Event) -> None:
    """Kills the code's processes first, so that bwrap reaps them and exits: killed first, bwrap would leave them
    to the host's PID 1, which in a container often reaps nobody (a zombie per timeout). Then the group."""
    for pid in _descendants(process.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if not exited.wait(KILL_GRACE_S):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        exited.wait()


def _descendants(pid: int) -> list[int]:
    """Every descendant of `pid`, read from /proc (children before grandchildren)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop(0)
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in children.read_text().split()]
                found += kids
                todo += kids
    return found


def _read(file, limit: int) -> tuple[str, bool]:
    file.seek(0)
    data = file.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _exit(returncode: int, bubblewrapped: bool) -> tuple[int | None, int | None]:
    """(exit code, signal): bwrap reports a child killed by signal N as 128 + N."""
    if returncode < 0:
        return None, -returncode
    if bubblewrapped and returncode > 128:
        return None, returncode - 128
    return returncode, None


def _status(
    exit_code, killed_by, timed_out: bool, cpu_seconds: float, stderr: str, config: SandboxConfig
) -> tuple[Status, str]:
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if timed_out:
        return "timeout", f"ran past the wall-clock limit ({config.wall_seconds:g} s) and was killed"
    if killed_by == signal.SIGXCPU or (killed_by == signal.SIGKILL and cpu_seconds >= config.cpu_seconds):
        return "cpu_limit", f"used its {config.cpu_seconds} s of CPU time ({cpu_seconds:.1f} s) and was killed"
    if killed_by == signal.SIGXFSZ or any(sign in stderr for sign in FILE_SIZE_SIGNS):
        return "output_limit", f"wrote past the {config.max_file_bytes}-byte file limit (stdout included)"
    if any(sign in last for sign in MEMORY_SIGNS):
        return "memory_limit", f"allocated past the {config.memory_mb} MB memory limit"
    if killed_by is not None:  # SIGKILL: the CPU limit's hard stop (SIGXCPU ignored) or the code itself
        return "killed", f"killed by signal {signal.Signals(killed_by).name}"
    if exit_code == 0:
        return "ok", ""
    if config.isolation == "bubblewrap" and last.startswith(BWRAP_MESSAGE):
        return "sandbox_failure", f"the sandbox did not start: {last}"
    return "error", f"exit status {exit_code}" + (f": {last[:300]}" if last else "")
