"""The health port (`--health-port`, issue 46's fix for health checks queued behind the data port's calls) under
hostile callers: 64 calls that open a check and never send its request, a `Watch` stream, an oversized service name,
an unknown one, and 2,000 probes on fresh connections; probes meanwhile, and the service's resident memory."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hostile.common import Service, Silent, checked, code_of, health_check_s

SILENT_CALLERS = 64
SILENT_HOLD_S = 15.0  # past the port's connection age (10 s) and its grace (2 s)
CHECK = "/grpc.health.v1.Health/Check"


def health_port_items(work: Path) -> dict:
    replay = Service("replay", data_dir=work / "health-port-redis", health_port=True)
    try:
        return {"46.13 the health port under hostile callers": checked(attack(replay), BOUNDS)}
    finally:
        replay.stop()


BOUNDS = {
    "probe_max_s while 64 silent calls are open": 1.0,
    "probes failed": 0,
    "silent calls still open after 15 s": 0,
    "rss_growth_mb": 64.0,
}


def attack(replay: Service) -> dict:
    address = replay.health_address
    rss_before = replay.rss_mb()[0]
    release = threading.Event()
    channels = [grpc.insecure_channel(address) for _ in range(SILENT_CALLERS)]
    silent = [
        channel.stream_unary(CHECK, request_serializer=lambda b: b).future(Silent(release), timeout=60)
        for channel in channels
    ]
    opened = time.monotonic()
    probes: list[float] = []
    failed = 0
    while time.monotonic() - opened < SILENT_HOLD_S:
        try:
            probes.append(health_check_s(address, timeout=5))
        except grpc.RpcError:
            failed += 1
        time.sleep(0.1)
    still_open = sum(not call.done() for call in silent)
    ended = Counter(call.code().name for call in silent if call.done())
    release.set()
    for channel in channels:
        channel.close()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    watch = lambda: list(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5))  # noqa: E731
    big = lambda: stub.Check(health_pb2.HealthCheckRequest(service="x" * 1_000_000), timeout=5)  # noqa: E731
    unknown = lambda: stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)  # noqa: E731
    started = time.monotonic()
    worst = 0.0
    for _ in range(2000):
        worst = max(worst, health_check_s(address, timeout=5))
    return {
        "silent calls": SILENT_CALLERS,
        "probes": len(probes),
        "probe_median_s": round(sorted(probes)[len(probes) // 2], 3),
        "probe_max_s while 64 silent calls are open": round(max(probes), 3),
        "probes failed": failed,
        "silent calls still open after 15 s": still_open,
        "silent calls ended by the server": dict(ended),
        "Watch": code_of(watch),
        "1 MB service name": code_of(big),
        "unknown service": code_of(unknown),
        "2,000 probes on new connections: s, slowest": [round(time.monotonic() - started, 1), round(worst, 3)],
        "rss_growth_mb": round(replay.rss_mb()[0] - rss_before, 1),
    }
