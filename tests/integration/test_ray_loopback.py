"""The local Ray that `rlep train` (and the test suite) starts listens on loopback only.

Ray's GCS, raylet, core workers and agents listen on every interface unless their node address is
loopback, and Ray swaps a requested 127.0.0.1 for the machine's external IP unless it is in its
"no cluster" mode (`rlep.common.ray_local.init_ray`). This checks every TCP port that any process
of the instance listens on, and that a second process (what `rlep train --ray-address` does) can join.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _ray_processes() -> list[psutil.Process]:
    """This process (the driver) and every process it started: the Ray head, its workers and agents."""
    return [psutil.Process(), *psutil.Process().children(recursive=True)]


def _listening(processes: list[psutil.Process]) -> list[tuple[str, int, str]]:
    found = []
    for process in processes:
        try:
            connections = process.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(c.laddr.ip, c.laddr.port, process.name()) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # "::ffff:127.0.0.1" from dual-stack sockets
    return (mapped or address).is_loopback


def test_local_ray_listens_on_loopback_only(ray_local):
    names = {p.name() for p in _ray_processes()}
    assert {"gcs_server", "raylet"} <= names, f"no Ray head among this process's children: {sorted(names)}"
    listening = _listening(_ray_processes())
    ray_ports = [entry for entry in listening if entry[2] in ("gcs_server", "raylet")]
    assert len(ray_ports) >= 2, listening  # the GCS and the raylet at least
    exposed = [entry for entry in listening if not _is_loopback(entry[0])]
    assert exposed == [], f"Ray ports reachable from other hosts: {exposed}"
    gcs = ray_local.get_runtime_context().gcs_address
    assert gcs.startswith("127.0.0.1:"), gcs


def test_another_process_joins_the_loopback_instance(ray_local):
    """`rlep train --ray-address` from a second process: it joins and runs a task there."""
    gcs = ray_local.get_runtime_context().gcs_address
    script = (
        f"import ray; ray.init(address={gcs!r}, log_to_driver=False); "
        "print(ray.get(ray.remote(lambda: 41 + 1).remote())); ray.shutdown()"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "42"
