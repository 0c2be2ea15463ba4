"""Writes a config file with the rollout replicas' gRPC addresses filled in, read from a Ray cluster.

On Kubernetes, rollout runs as a RayService: each Serve replica listens on a free port of its worker
pod and records its address in the application's registry actor (services/rollout/ray_app.py).
Clients outside Ray (the learner Job) get the list once, here, in an init container:

    python resolve_rollout.py --ray-address ray://rlep-rollout-head-svc:10001 --app rlep-rollout \
        --expect 2 --key endpoints.rollout --base /etc/rlep/config/train.yaml --out /run/rlep/train.yaml

A replica that Serve restarts later comes back on a new port; a restarted learner pod picks it up.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml


def with_addresses(base: dict[str, Any], dotted_key: str, addresses: list[str]) -> dict[str, Any]:
    """A copy of `base` with `addresses` at `dotted_key` (sections created as needed)."""
    result = dict(base)
    node = result
    *sections, leaf = dotted_key.split(".")
    for section in sections:
        node[section] = dict(node.get(section) or {})
        node = node[section]
    node[leaf] = list(addresses)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray-address", required=True, help="ray://HEAD:10001, or a GCS address")
    parser.add_argument("--app", default="rlep-rollout", help="the rollout application's name (app_name)")
    parser.add_argument("--expect", type=int, default=1, help="wait until this many replicas answer")
    parser.add_argument("--wait-s", type=float, default=1800.0, help="give up after this long")
    parser.add_argument("--key", default="endpoints.rollout", help="dotted config key to set")
    parser.add_argument("--base", type=Path, required=True, help="config file to start from")
    parser.add_argument("--out", type=Path, required=True, help="where to write the result")
    args = parser.parse_args(argv)

    import ray

    from rlep.services.rollout.ray_app import replica_addresses

    ray.init(address=args.ray_address, log_to_driver=False)
    try:
        addresses = replica_addresses(args.app, wait_s=args.wait_s, expect=args.expect)
    finally:
        ray.shutdown()
    if len(addresses) < args.expect:
        raise SystemExit(f"only {len(addresses)} of {args.expect} rollout replicas answered: {addresses}")
    base = yaml.safe_load(args.base.read_text()) or {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(yaml.safe_dump(with_addresses(base, args.key, addresses), sort_keys=False))
    print(f"{args.key} = {addresses} -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
