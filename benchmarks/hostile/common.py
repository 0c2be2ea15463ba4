"""What every part of the campaign shares: a `rlep serve` process, the health probe, timings, status codes, idle
streams, resident memory, and the check of a figure against its bound."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.grpc_channel import make_channel
from rlep.common.ports import free_port

RLEP = str(Path(sys.executable).with_name("rlep"))


class Service:
    """One `rlep serve` process; `output` is everything it printed (read after `stop`)."""

    def __init__(
        self, name: str, *sets: str, data_dir: Path | None = None, http: bool = False, health_port: bool = False
    ):
        """`health_port`: also `--health-port` (`health_address`), the port probes are meant to use."""
        self.port = free_port()
        args = [RLEP, "serve", name, "--port", str(self.port)]
        self.health_address = None
        if health_port:
            port = free_port()
            args += ["--health-port", str(port)]
            self.health_address = f"127.0.0.1:{port}"
        for value in [*sets, *([f"local_redis_dir={data_dir}"] if data_dir else [])]:
            args += ["--set", value]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.address, self.url, self.output = f"127.0.0.1:{self.port}", f"http://127.0.0.1:{self.port}", ""
        deadline = time.monotonic() + 300
        while not (self._http_up() if http else self._grpc_up()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rlep serve {name} did not start: {self.proc.stdout.read()[-2000:]}")
            time.sleep(0.2)

    def _grpc_up(self) -> bool:
        try:
            return health_check_s(self.address, timeout=1) is not None
        except grpc.RpcError:
            return False

    def _http_up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def redis_child(self) -> psutil.Process:
        [child] = [p for p in psutil.Process(self.proc.pid).children() if "redis-server" in p.name()]
        return child

    def rss_mb(self) -> tuple[float, float]:
        """Resident MB of the service's own process, and of it with its children (workers, an embedded Redis)."""
        own = psutil.Process(self.proc.pid)
        children = 0
        for child in own.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):  # a worker replaced meanwhile
                children += child.memory_info().rss
        rss = own.memory_info().rss
        return rss / 1e6, (rss + children) / 1e6

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        self.output, _ = self.proc.communicate(timeout=60)
        return self.proc.returncode


def health_check_s(address: str, timeout: float = 5) -> float | None:
    """Seconds one gRPC health check took, or None when it did not answer SERVING."""
    started = time.perf_counter()
    with make_channel(address) as channel:  # a new connection each time, as a kubelet's probe makes; then closed
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return time.perf_counter() - started if reply.status == health_pb2.HealthCheckResponse.SERVING else None


def timed_max(call, times: int = 5) -> float:
    """The slowest of `times` calls, in seconds (a call that fails raises)."""
    worst = 0.0
    for _ in range(times):
        started = time.perf_counter()
        call()
        worst = max(worst, time.perf_counter() - started)
    return round(worst, 3)


def code_of(call) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as err:
        return err.code().name


def checked(figures: dict, bounds: dict) -> dict:
    """`figures` with the bound each named figure must stay within (at most) and whether it did, so that a reader
    of the JSON can check every claim: `bounds` maps a key of `figures` to its largest allowed value (a figure of
    None, not measured, is not met)."""
    met = {key: figures[key] is not None and figures[key] <= bound for key, bound in bounds.items()}
    return {**figures, "bounds": bounds, "met": met}


class Silent:
    """A request stream opened and left idle, with no deadline, until released."""

    def __init__(self, release: threading.Event):
        self.release = release

    def __iter__(self):
        return self

    def __next__(self):
        self.release.wait()
        raise StopIteration


def idle_streams(address: str, method, other_call, count: int) -> dict:
    """Item 1: `count` idle client streams on `method`; how the others fare while they are open, and their end."""
    release = threading.Event()
    streams = [method(make_channel(address)).future(Silent(release)) for _ in range(count)]
    opened = time.monotonic()
    time.sleep(1.0)  # let the admitted ones reach their handlers (a measurement pause, not a synchronisation)
    refused = Counter(s.exception().code().name for s in streams if s.done())
    figures = {
        "streams": count,
        "refused_at_once": dict(refused),
        "health_max_s": timed_max(lambda: health_check_s(address)),
        "other_call_max_s": timed_max(other_call),
    }
    ended = Counter(s.exception(timeout=120).code().name for s in streams)
    figures["all_ended_after_s"] = round(time.monotonic() - opened, 1)
    figures["ended_with"] = dict(ended)
    release.set()
    return figures
