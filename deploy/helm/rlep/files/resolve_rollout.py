"""Waits until a Ray cluster's rollout application has `--expect` replicas answering (the learner's and eval's
init container on Kubernetes).

Each Serve replica serves gRPC on the fixed port of its worker pod (`rollout.port`) and records its address in
the application's registry actor (services/rollout/ray_app.py). The learner and eval do not take the list from
here: they resolve the replicas' headless Service before every step or job (`endpoints.rollout_service`,
services/rollout/discovery.py), so replicas that come back on new pods are used again. This gate only keeps
them from starting before the replicas have loaded their model:

    python resolve_rollout.py --ray-address ray://rlep-rollout-head-svc:10001 --app rlep-rollout --expect 2

KubeRay creates the head Service only once the Serve application runs, so the script first waits for the
Service's name to resolve and for the Ray client to connect, then for `--expect` replicas to answer; all of
it within `--wait-s`, after which it exits non-zero.
"""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

# Between attempts to reach the head: KubeRay's Service appears within seconds of the app running, and a
# refused Ray client connection costs nothing.
RETRY_INTERVAL_S = 5.0


def connect(
    address: str,
    wait_s: float,
    init: Callable[[str], Any],
    resolve: Callable[[str, int], Any] = socket.getaddrinfo,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Waits for `address`'s host to resolve, then calls `init(address)` until it connects.

    Returns the seconds left of `wait_s`; raises SystemExit (naming the last error) when it runs out.
    """
    deadline = clock() + wait_s
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    error: Exception | None = None
    while clock() < deadline:
        try:
            resolve(parts.hostname, parts.port or 10001)
            init(address)
            return max(deadline - clock(), 0.0)
        except (OSError, ConnectionError) as err:  # gaierror: no Service yet; ConnectionError: not serving yet
            error = err
            print(f"waiting for {address}: {err}", flush=True)
            sleep(RETRY_INTERVAL_S)
    raise SystemExit(f"{address} did not answer within {wait_s:.0f} s (last error: {error})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray-address", required=True, help="ray://HEAD:10001, or a GCS address")
    parser.add_argument("--app", default="rlep-rollout", help="the rollout application's name (app_name)")
    parser.add_argument("--expect", type=int, default=1, help="wait until this many replicas answer")
    parser.add_argument("--wait-s", type=float, default=1800.0, help="give up after this long")
    args = parser.parse_args(argv)

    import ray

    from rlep.services.rollout.ray_app import replica_addresses

    left_s = connect(args.ray_address, args.wait_s, init=lambda address: ray.init(address=address, log_to_driver=False))
    try:
        addresses = replica_addresses(args.app, wait_s=left_s, expect=args.expect)
    finally:
        ray.shutdown()
    if len(addresses) < args.expect:
        raise SystemExit(f"only {len(addresses)} of {args.expect} rollout replicas answered: {addresses}")
    print(f"{len(addresses)} rollout replicas answer: {addresses}", flush=True)


if __name__ == "__main__":
    main()
