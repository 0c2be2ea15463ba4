"""Container health check: `python healthcheck.py grpc HOST:PORT` or `python healthcheck.py http URL`.

Exit 0 when the service answers SERVING (gRPC health, which needs no token) or HTTP 200, 1 otherwise.
Docker's HEALTHCHECK has no gRPC probe and the image ships no grpc_health_probe binary, so compose
runs this with the image's own Python and grpcio.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

# Docker kills a check that outlives its own timeout (5 s in docker-compose.yml); answer before that.
TIMEOUT_S = 3.0


def grpc_serving(address: str) -> bool:
    from rlep.common.health import is_serving  # TLS when RLEP_TLS_CA_FILE is set, as for every client

    return is_serving(address, TIMEOUT_S)


def http_ok(url: str) -> bool:
    import os
    import ssl

    ca_file = os.environ.get("RLEP_TLS_CA_FILE")
    context = ssl.create_default_context(cafile=ca_file) if ca_file and url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("grpc", "http"):
        print("usage: healthcheck.py grpc HOST:PORT | http URL", file=sys.stderr)
        return 2
    kind, target = argv
    healthy = grpc_serving(target) if kind == "grpc" else http_ok(target)
    if not healthy:
        print(f"{kind} {target}: not healthy", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
