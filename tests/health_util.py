"""Watching a service's gRPC health in tests: what it said until it turned NOT_SERVING (or went away)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2


def statuses_until_not_serving(watch) -> list:
    """The statuses a health `Watch` stream sent, up to the first NOT_SERVING; ends early if the service went away
    (what it said before is what is returned)."""
    statuses = []
    try:
        for reply in watch:
            statuses.append(reply.status)
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
    except grpc.RpcError:
        pass
    return statuses
