"""A local Ray instance held to loopback, or a cluster's address: how every process of a run joins Ray."""

from __future__ import annotations

import os

import ray

from rlep.common.errors import UserError

# Ray's own switch for "no cluster, this machine only" (its Windows/macOS default). Only with it off does
# Ray keep a loopback node address: otherwise it swaps 127.0.0.1 for the machine's external IP, and its GCS,
# raylet, workers and agents then listen on every interface (measured: 12 of 13 ports on 0.0.0.0, * or the
# external IP per start; 0 with this).
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Joins `address`, or starts a local Ray bound to loopback only (no dashboard; token auth off, as nothing
    off this host can reach it)."""
    if ray.is_initialized():
        return
    if address:
        try:
            ray.init(address=address, log_to_driver=False)
        except Exception as err:  # a wrong address, a cluster of another Ray version, one that went away
            raise UserError(
                f"could not join the Ray cluster at {address} ({_one_line(err)}); check --ray-address "
                f"(`ray status --address {address}` on a node of it), or drop it to start Ray on this machine"
            ) from err
        return
    from ray._private import ray_constants

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ[LOOPBACK_ONLY_ENV] = "0"  # for the processes Ray starts
    # Ray read the variable when it was imported: set what it read, for this (driver) process.
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address=LOOPBACK,
        )
    except Exception as err:  # under load its processes can miss their start deadlines: 54 lines of traceback
        raise UserError(
            f"Ray did not start on this machine ({_one_line(err)}); its logs are in "
            f"{os.environ.get('RAY_TMPDIR', '/tmp')}/ray/session_latest/logs. "
            f"Rerun once the machine is less busy, or start Ray yourself (`ray start --head`) and pass --ray-address"
        ) from err


def _one_line(err: Exception, limit: int = 300) -> str:
    """The exception's type and message on one line, cut to `limit` characters (Ray's can run to pages)."""
    line = " ".join(f"{type(err).__name__}: {err}".split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
