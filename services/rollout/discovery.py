"""Rollout replicas named by DNS: `NAME:PORT`, where NAME resolves to every replica's IP and each serves on PORT.

On Kubernetes, NAME is a headless Service of the rollout worker pods (one Ray Serve replica per pod, on the
fixed port of services/rollout/replica_port.py). Its records follow the pods: a replica rescheduled onto a new
pod appears under the new pod's IP once the pod is Ready, and a deleted pod's IP drops out. The typed client
re-resolves the name before every learner step (`RolloutClient.from_service`, `refresh`), and the learner
health-checks every address and brings a replica that (re)joined to its weight version before it serves,
as it does for replicas from the Ray registry.

What DNS cannot say: whether the replica in a Ready pod has loaded its engine. An address that does not answer
is left out of serving by that check until it does.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

Resolver = Callable[..., list[tuple[Any, ...]]]


def parse_service(service: str) -> tuple[str, int]:
    """`NAME:PORT` -> (NAME, PORT); ValueError with the reason when it is not one."""
    name, sep, port = service.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"rollout service {service!r} is not NAME:PORT with a port in 1..65535")
    return name, int(port)


def resolve_service(service: str, resolve: Resolver = socket.getaddrinfo) -> list[str]:
    """The replicas' `host:port` addresses, sorted and distinct; [] when the name does not resolve (no Ready pod
    yet, or DNS down: callers keep the replicas they know).

    Args:
        service: `NAME:PORT`.
        resolve: `socket.getaddrinfo` (tests pass another resolver).
    """
    name, port = parse_service(service)
    try:
        records = resolve(name, port, type=socket.SOCK_STREAM)
    except OSError:  # socket.gaierror: NXDOMAIN for a headless Service without Ready pods, or no answer
        return []
    hosts = {ipaddress.ip_address(record[4][0]) for record in records}
    return [format_address(str(host), port) for host in sorted(hosts, key=lambda ip: (ip.version, ip))]


def format_address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets (as gRPC targets need)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
