"""Which port a Ray Serve rollout replica serves gRPC on: any free one, or a fixed one a firewall can name. Its
/metrics port, when asked for (`local.rollout_metrics_port`), is chosen the same way from a range of its own.

With `base` > 0 a replica serves on `base + slot`, the first of `slots` ports (the most replicas one node may
hold: Serve's `max_replicas_per_node`) that no other replica of this host claimed and nothing else listens on.
On Kubernetes one replica runs per pod, so every replica serves on `base` and the NetworkPolicy admits callers
on that port only. No free slot is an error naming the ports tried, never a silent fall back to a random port.

A claim is a lock file per port (`fcntl.flock`, released when the replica's process dies, however it dies),
taken before vLLM loads: two replicas starting together on one node get distinct slots, although neither
binds its gRPC port until its engine has loaded minutes later. Ports are a network namespace's and the locks
a file system's; a container has its own of both, and `build_server` refuses to share a port
(`grpc.so_reuseport` off), so a port taken by something that claimed no lock fails the bind loudly.
"""

from __future__ import annotations

import fcntl
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rlep.services.rollout.config import port_range_error

ANY_PORT = 0  # no fixed port: any free one
# Where a replica's base ports come from: `rlep train`'s local section, or the Serve app's args (`serve deploy`).
GRPC_PORT_SETTING = "local.rollout_port (Serve app: port)"
METRICS_PORT_SETTING = "local.rollout_metrics_port (Serve app: metrics_port)"


class NoFreeReplicaPort(RuntimeError):
    """Every port of a replica's slots is claimed by another replica or in use."""


@dataclass
class PortClaim:
    """A replica's port (0: any free one) and the lock that keeps other replicas of this host off it."""

    port: int
    lock: IO[bytes] | None = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # closing the file drops the flock
            self.lock = None


def claim_port(
    host: str, base: int, slots: int = 1, lock_dir: Path | None = None, setting: str = GRPC_PORT_SETTING
) -> PortClaim:
    """The first of ports `base .. base + slots - 1` that no other replica claimed and `host` can bind.

    Args:
        host: the address the replica's gRPC server will bind.
        base: the first port; 0 = any free port (no claim, no lock).
        slots: how many consecutive ports replicas of one host may use.
        lock_dir: where the per-port lock files live (default: the system's temporary directory).
        setting: the setting `base` came from, named in the error.
    Returns:
        The claim; hold it while the replica serves (`release` or process exit drops it).
    Raises:
        NoFreeReplicaPort: naming each port tried and why it was passed over.
    """
    if base == ANY_PORT:
        return PortClaim(ANY_PORT)
    if error := port_range_error(base, slots):
        raise ValueError(error)
    lock_dir = lock_dir or Path(tempfile.gettempdir())
    passed = []
    for port in range(base, base + slots):
        lock = _try_lock(lock_dir / f"rlep-rollout-port-{port}.lock")
        if lock is None:
            passed.append(f"{port} (claimed by another replica)")
        elif not _bindable(host, port):
            lock.close()
            passed.append(f"{port} (in use)")
        else:
            return PortClaim(port, lock)
    raise NoFreeReplicaPort(
        f"no free rollout replica port for {setting} on {host}: {', '.join(passed)}. Give the replicas more ports "
        "per node (local.rollout_max_per_node / max_per_node), fewer replicas per node, or another base port"
    )


def _try_lock(path: Path) -> IO[bytes] | None:
    """The open lock file, locked by us; None when another process holds it."""
    handle = open(path, "ab")  # noqa: SIM115 - held open for the claim's lifetime
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _bindable(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now (SO_REUSEADDR, as gRPC sets it: a port left in TIME_WAIT by
    a replica that died is free; one another process listens on is not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
