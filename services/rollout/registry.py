"""Where the replicas of a Ray Serve rollout application are: a small named actor (the registry) that each
replica writes its gRPC address (and /metrics URL) into, and the lookup the typed client and the stack read it with
(`RolloutClient.from_ray`). Plain Ray, no Serve: a client reads it without importing the deployment
(ray_app.py, which registers)."""

from __future__ import annotations

import time

import ray

from rlep.common.health import is_serving

REGISTRY_NAMESPACE = "rlep"


@ray.remote(num_cpus=0)
class ReplicaRegistry:
    """replica id -> gRPC address (and /metrics URL, when it serves one) of the live replicas of one rollout
    application."""

    def __init__(self) -> None:
        self._addresses: dict[str, str] = {}
        self._metrics_urls: dict[str, str] = {}

    def register(self, replica_id: str, address: str, metrics_url: str | None = None) -> None:
        self._addresses[replica_id] = address
        self._metrics_urls.pop(replica_id, None)
        if metrics_url is not None:
            self._metrics_urls[replica_id] = metrics_url

    def unregister(self, replica_id: str) -> None:
        self._addresses.pop(replica_id, None)
        self._metrics_urls.pop(replica_id, None)

    def addresses(self) -> dict[str, str]:
        return dict(self._addresses)

    def metrics_urls(self) -> dict[str, str]:
        """gRPC address -> /metrics URL of the replicas that serve /metrics."""
        return {self._addresses[replica_id]: url for replica_id, url in self._metrics_urls.items()}


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


def replica_metrics_urls(app_name: str = "rlep-rollout") -> dict[str, str]:
    """gRPC address -> Prometheus /metrics URL of each live registered replica that serves /metrics
    (`local.rollout_metrics_port`, or `server.metrics_port` in a deployed app's config)."""
    live = set(replica_addresses(app_name, wait_s=0))
    return {
        address: url for address, url in ray.get(registry(app_name).metrics_urls.remote()).items() if address in live
    }
