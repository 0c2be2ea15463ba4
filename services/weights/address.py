"""The address a broadcast group's store listens at (the host of the learner's rank 0) when `weight_sync.master_address`
is `auto`, and which addresses reach this host only.

Every replica's workers connect to that address, so it must be one their hosts reach. Ray's node IP is one on a Ray
cluster, but `rlep train` without `--ray-address` starts a Ray held to loopback (rlep_common/ray_local.py) whose node
IP is 127.0.0.1, as in the Helm chart's learner pod and the compose learner container. There the deployment names the
host's address in RLEP_NODE_ADDRESS: the chart sets the pod IP (downward API, `status.podIP`), docker-compose.yml the
container's address on the compose network.
"""

from __future__ import annotations

import ipaddress
import os

NODE_ADDRESS_ENV = "RLEP_NODE_ADDRESS"


def node_address() -> str:
    """This host's address as other hosts reach it: RLEP_NODE_ADDRESS when set, else Ray's node IP (127.0.0.1 under a
    Ray held to loopback). Asked on the host of the learner's rank 0, where the group's store listens."""
    import ray  # here, not at import: rollout workers import this layer and never ask

    return os.environ.get(NODE_ADDRESS_ENV, "").strip() or ray.util.get_node_ip_address()


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP, no port) reaches only the host that uses it: `localhost`, 127.0.0.0/8, ::1, or
    an unspecified address. Other names are not resolved (that could wait on DNS), so they count as routable."""
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified
