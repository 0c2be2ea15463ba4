"""Bytes a weight push puts through Ray's object store: the driver-side push (the policy's state dict returned
through Ray to the driver, which then pushes) vs the learner-side push (`Policy.push_weights`: rank 0 writes
and sends the weights itself), side by side on the same learner and replica.

Ray counts every object created in its object store (`cumulative_created_bytes` of the raylets' store stats,
summed over the cluster); the figure is that counter's growth over one push. Small results travel inline in
Ray's RPCs and create no object, so the learner-side push's figure is expected to be 0.

Used by benchmarks/rollout.py; alone (tiny model, one `rlep serve rollout` worker):

    python benchmarks/ray_bytes.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def object_store_created_bytes() -> int:
    """Bytes ever created in the Ray cluster's object store (all nodes)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return int(get_memory_info_reply(state).store_stats.cumulative_created_bytes)


def push_object_store_bytes(model_dir: Path, address: str, rounds: int = 3, first_version: int = 1000) -> dict:
    """Object-store bytes per push, driver-side vs learner-side, median of `rounds` alternated pushes of the
    weights of `model_dir` to the replica at `address` (which must serve that model)."""
    from rlep.common.ray_local import init_ray
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.ray_policy import RayPolicy
    from rlep.services.rollout.client import RolloutClient
    from rlep.services.weights.config import SharedFileSyncConfig
    from rlep.services.weights.transport import SharedFileTransport

    init_ray()
    config = TrainConfig.model_validate({"deepspeed": {"zero_stage": 2}, "local": {"learner_cpus": 0.5}})
    policy = RayPolicy(model_dir, config)
    client = RolloutClient([address])
    figures: dict[str, list[int]] = {"driver_side": [], "learner_side": []}
    version = first_version
    try:
        weight_bytes = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
        for _ in range(rounds):
            version += 1
            before = object_store_created_bytes()
            client.push_weights(policy.state_dict(), version, transport=SharedFileTransport())  # the old path
            figures["driver_side"].append(object_store_created_bytes() - before)
            version += 1
            before = object_store_created_bytes()
            client.take_push_result(policy.push_weights(client.target(), version, SharedFileSyncConfig()))
            figures["learner_side"].append(object_store_created_bytes() - before)
        assert client.versions() == [version], "the replica did not end on the last pushed version"
    finally:
        policy.close()
        client.close()
    return {"weight_bytes": weight_bytes, **{k: int(statistics.median(v)) for k, v in figures.items()}}


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from benchmarks.rollout_worker import start_worker
    from rlep.common.ports import free_port
    from rlep.common.tiny_model import cached_model

    model = cached_model("tiny")
    port = free_port()
    worker = start_worker(argparse.Namespace(eager=True), str(model), port)
    try:
        result = push_object_store_bytes(model, f"127.0.0.1:{port}", args.rounds)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    table = Table(title="Ray object-store bytes per weight push (tiny model, median)")
    for column in ("weights", "driver-side push (before)", "learner-side push (now)"):
        table.add_column(column, justify="right")
    table.add_row(*(f"{result[k]:,}" for k in ("weight_bytes", "driver_side", "learner_side")))
    Console().print(table)


if __name__ == "__main__":
    main()
