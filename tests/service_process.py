"""`rlep serve <service>` as operators run it, for tests: a process of its own, watched while it starts.

- It binds the port it picks itself (`--port 0`) and the test reads it from its "listening on" line. A port the test
  chose beforehand could be taken by something else during a vLLM worker's minute-long start; its bind then failed,
  the worker exited, and a wait that did not watch the process polled a dead port until pytest's 600 s timeout
  (CI, 2026-11-27, test_rollout_process.py).
- A start that fails fails the wait at once, with the end of the process's output in the message; one that does
  not serve in time writes every thread's stack there first (SIGUSR1), then is killed.
- Its output goes to a file, not a pipe: a pipe nobody reads until the end fills (64 KB) and blocks every thread
  that logs, which once froze a service mid-test.
- It is stopped as a supervisor stops it (SIGTERM: SIGKILL would orphan a vLLM engine core, ~2 GB); only a process
  that outlives the wait is killed, with its children.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from rlep.common.health import HEALTH_CALL_TIMEOUT_S, is_serving
from rlep.common.lifecycle import STACK_DUMP_SIGNAL

STARTUP_TIMEOUT_S = 60.0  # a gRPC service without a model; a vLLM worker is given more (ROLLOUT_STARTUP_TIMEOUT_S)
ROLLOUT_STARTUP_TIMEOUT_S = 300.0  # a vLLM-CPU worker starts in 35-90 s on 2 cores, alone
POLL_S = 0.2
LISTENING = re.compile(r"\b(\w+) listening on (?:https?://)?[\w.\-]+:(\d+)")
TAIL_CHARS = 8000
STACK_DUMP_MARK = "(most recent call first)"  # faulthandler's header of each thread's stack
# faulthandler writes thread by thread, newest first, so the main thread comes last, and its last line is the
# script's own frame: the dump is whole when that line is there (reading at the first header once saw only a
# worker thread's stack, CI 2026-11-28, test_serve_verifier_process).
STACK_DUMP_END = re.compile(r'^  File ".*", line \d+ in <module>$', re.MULTILINE)
STACK_DUMP_TIMEOUT_S = 10.0


def _whole_dump(text: str) -> bool:
    return STACK_DUMP_MARK in text and STACK_DUMP_END.search(text) is not None


def rlep_command() -> list[str]:
    script = Path(sys.executable).with_name("rlep")
    return [str(script)] if script.exists() else [shutil.which("rlep") or "rlep"]


class ServiceProcess:
    """A started `rlep serve` process; `port` is known once `wait_ready` returned."""

    def __init__(self, service: str, output_path: Path, args: Sequence[str] = (), sets: Sequence[str] = ()):
        self.service = service
        self.output_path = output_path
        self.port: int | None = None
        command = [*rlep_command(), "serve", service, "--port", "0", *args]
        command += [a for s in sets for a in ("--set", s)]
        output_path.parent.mkdir(parents=True, exist_ok=True)
        with output_path.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def address(self) -> str:
        assert self.port is not None, "not listening yet: call wait_ready first"
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """Eval's base URL (HTTP)."""
        return f"http://{self.address}"

    def wait(self, timeout_s: float) -> int:
        """Until it ends by itself (a retiring service); its exit status."""
        return self.proc.wait(timeout=timeout_s)

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def _failure(self, what: str) -> str:
        return f"rlep serve {self.service} {what}; its output ends:\n{self.output()[-TAIL_CHARS:]}"

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S, tls_ca_file: Path | None = None) -> None:
        """Until it prints its port and its health check (gRPC) or /healthz (eval, plain HTTP) answers; fails at once
        when the process ends first, and after `timeout_s` (killing it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                code = self.proc.wait(timeout=POLL_S)  # returns the moment it exits: no blind sleep
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                raise AssertionError(self._failure(f"exited with status {code} before it served"))
            if self.port is None and (match := self._listening()):
                self.port = int(match)
            if self.port is not None and self._ready(tls_ca_file):
                return
            if time.monotonic() > deadline:
                self.dump_stacks()
                self.kill()
                raise AssertionError(self._failure(f"did not serve within {timeout_s:.0f} s (stacks above; killed)"))

    def _listening(self) -> str | None:
        for match in LISTENING.finditer(self.output()):
            if match.group(1) == self.service:
                return match.group(2)
        return None

    def _ready(self, tls_ca_file: Path | None) -> bool:
        if self.service == "eval":  # HTTP
            try:
                return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        host = "localhost" if tls_ca_file else "127.0.0.1"  # a certificate names localhost
        return is_serving(f"{host}:{self.port}", HEALTH_CALL_TIMEOUT_S, tls_ca_file)

    def dump_stacks(self, timeout_s: float = STACK_DUMP_TIMEOUT_S) -> bool:
        """Has the process write every thread's stack into its output (`rlep serve` registers SIGUSR1 for it);
        whether the whole dump, down to the main thread's first frame, showed up within `timeout_s`."""
        start = len(self.output())
        self.proc.send_signal(STACK_DUMP_SIGNAL)
        deadline = time.monotonic() + timeout_s
        while not _whole_dump(self.output()[start:]):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return False
            time.sleep(POLL_S)  # a file has no hook to wait on; bounded by `timeout_s`
        return True

    def stop(self, timeout_s: float = 60.0) -> str:
        """SIGTERM and wait for it to end; returns its whole output. One that does not end in time is killed (with
        its children) and the test fails."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(self._failure(f"did not stop within {timeout_s:.0f} s of SIGTERM (killed)")) from None
        return self.output()

    def kill(self) -> None:
        """SIGKILL to it and every process it started (a vLLM engine core, a redis-server)."""
        if self.proc.poll() is not None:
            return  # ended and reaped: its pid may be another process's now
        with contextlib.suppress(psutil.NoSuchProcess):
            family = psutil.Process(self.proc.pid).children(recursive=True)
            self.proc.kill()
            for child in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        self.proc.wait()


def start_service(
    service: str,
    output_path: Path,
    args: Sequence[str] = (),
    sets: Sequence[str] = (),
    timeout_s: float = STARTUP_TIMEOUT_S,
    tls_ca_file: Path | None = None,
) -> ServiceProcess:
    """`rlep serve <service> --port 0 <args> --set <sets>`, returned once it serves (see the module's docstring)."""
    started = ServiceProcess(service, output_path, args, sets)
    try:
        started.wait_ready(timeout_s, tls_ca_file)
    except BaseException:
        started.kill()  # a no-op when it already ended
        raise
    return started
