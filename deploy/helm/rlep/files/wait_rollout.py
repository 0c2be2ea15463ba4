"""Waits until `--expect` rollout replicas answer: the start gate of the learner's and eval's pods on Kubernetes
(the chart's `wait-rollout` init container).

It finds the replicas the way the learner and eval find them before every step or job: through the headless
Service of the rollout worker pods, `NAME:PORT`, each replica serving gRPC on that fixed port
(`endpoints.rollout_service`, services/rollout/discovery.py). A worker pod is in the Service's records once Ray
runs in it, before its replica has loaded the model, so each address must also answer the check the learner
makes before a step (`RolloutClient.check`: GetStatus with RLEP's bearer token, over TLS when
`RLEP_TLS_CA_FILE` is set). A replica whose engine has died answers UNAVAILABLE and does not count.

    python wait_rollout.py --service rlep-rollout-replicas:50063 --expect 2 \
        --token-file /etc/rlep/secrets/auth-token --wait-s 1800

No Ray is involved: the pod needs neither Ray's token nor a way to the Ray head. While it waits it prints what
it sees; once `--wait-s` has passed it exits non-zero naming what it saw last. A replica that refuses the token
(UNAUTHENTICATED) ends the wait at once: time does not change that.
"""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rlep.services.rollout.discovery import Resolver, resolve_service

# Between looks: a worker pod joins the Service once Ray runs in it, its replica answers once the model is
# loaded (minutes); a look costs one DNS query and one GetStatus per address.
RETRY_INTERVAL_S = 5.0
# One GetStatus: a loaded replica answers at once and a pod with no server yet refuses the connection at once;
# this bounds a replica that accepts but hangs, or packets that are dropped.
CHECK_TIMEOUT_S = 10.0

# Addresses -> those whose replica answers.
Check = Callable[[Sequence[str]], list[str]]


def describe(addresses: Sequence[str], answering: Sequence[str]) -> str:
    """What one look saw, for the progress lines and the final error."""
    if not addresses:
        return "the name resolves to no address (no Ready rollout worker pod yet)"
    silent = [a for a in addresses if a not in answering]
    seen = f"{len(addresses)} resolve, {len(answering)} answer {list(answering)}"
    return f"{seen}, not answering {silent}" if silent else seen


def wait_for_replicas(
    service: str,
    expect: int,
    wait_s: float,
    check: Check,
    resolve: Resolver = socket.getaddrinfo,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Resolves `service` and checks its addresses until at least `expect` of them answer.

    Args:
        service: `NAME:PORT` of the replicas' headless Service.
        expect: how many replicas must answer.
        wait_s: how long to keep looking.
        check: addresses -> those that answer (`check_replicas`; tests pass another).
        resolve: `socket.getaddrinfo` (tests pass another resolver).

    Returns:
        The addresses that answered, sorted.

    Raises:
        SystemExit: naming what the last look saw, once `wait_s` has passed.
    """
    deadline = clock() + wait_s
    while True:
        addresses = resolve_service(service, resolve)
        answering = sorted(check(addresses)) if addresses else []
        seen = describe(addresses, answering)
        if len(answering) >= expect:
            return answering
        if clock() >= deadline:
            raise SystemExit(f"{expect} rollout replicas at {service} did not answer within {wait_s:.0f} s: {seen}")
        print(f"waiting for {expect} rollout replicas at {service}: {seen}", flush=True)
        sleep(RETRY_INTERVAL_S)


def check_replicas(addresses: Sequence[str], token: str | None) -> list[str]:
    """The addresses whose replica answers GetStatus: the learner's own check (`RolloutClient.check`), with its
    token and TLS. Raises grpc.RpcError for an answer that is not a replica being down (UNAUTHENTICATED)."""
    from rlep.services.rollout.client import RolloutClient

    client = RolloutClient(addresses, token=token)
    try:
        return [replica.address for replica, status in client.check(CHECK_TIMEOUT_S) if status is not None]
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", required=True, help="NAME:PORT of the rollout replicas' headless Service")
    parser.add_argument("--expect", type=int, default=1, help="wait until this many replicas answer")
    parser.add_argument("--wait-s", type=float, default=1800.0, help="give up after this long")
    parser.add_argument("--token-file", type=Path, help="RLEP's bearer token (the replicas' auth_token_file)")
    args = parser.parse_args(argv)

    import grpc

    from rlep.common.files import read_token_file

    token = read_token_file(args.token_file)
    try:
        answering = wait_for_replicas(args.service, args.expect, args.wait_s, lambda a: check_replicas(a, token))
    except grpc.RpcError as err:
        raise SystemExit(
            f"a rollout replica at {args.service} refused the check: {err.code().name} {err.details()}"
        ) from err
    print(f"{len(answering)} rollout replicas answer at {args.service}: {answering}", flush=True)


if __name__ == "__main__":
    main()
