"""Where the replicas of a Ray Serve rollout application are: a small named actor (the registry) that each
replica writes its gRPC address into, and the lookup the typed client and the stack read it with
(`RolloutClient.from_ray`). Plain Ray, no Serve: a client reads it without importing the deployment
(ray_app.py, which registers)."""

from __future__ import annotations

import time

import ray

from rlep.common.health import is_serving

REGISTRY_NAMESPACE = "rlep"


@ray.remote(num_cpus=0)
class ReplicaRegistry:
    """replica id -> gRPC address of the live replicas of one rollout application."""

    def __init__(self) -> None:
        self._addresses: dict[str, str] = {}

    def register(self, replica_id: str, address: str) -> None:
        self._addresses[replica_id] = address

    def unregister(self, replica_id: str) -> None:
        self._addresses.pop(replica_id, None)

    def addresses(self) -> dict[str, str]:
        return dict(self._addresses)


# Ray's resource of the head node: the registry lives there, so losing a worker node (and its replicas) never
# loses the other replicas' registrations (Ray Train pins its state actor the same way).
HEAD_NODE = {"node:__internal_head__": 0.001}


def registry(app_name: str):
    return ReplicaRegistry.options(
        name=f"{app_name}-registry",
        namespace=REGISTRY_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        resources=HEAD_NODE,
        scheduling_strategy="DEFAULT",  # not inside the creating replica's placement group
    ).remote()


def replica_addresses(app_name: str = "rlep-rollout", wait_s: float = 120.0, expect: int = 1) -> list[str]:
    """Addresses of the live registered replicas (waits until at least `expect` answer).

    Entries of replicas that died without unregistering (a killed process) are dropped here.
    """
    deadline = time.monotonic() + wait_s
    handle = registry(app_name)
    while True:
        addresses = {}
        for replica_id, address in ray.get(handle.addresses.remote()).items():
            if is_serving(address):
                addresses[replica_id] = address
            else:
                handle.unregister.remote(replica_id)
        if len(addresses) >= expect or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not addresses:
        raise RuntimeError(f"no rollout replica registered for Ray Serve application {app_name!r}")
    return sorted(addresses.values())
