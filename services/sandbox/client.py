"""Typed client of the sandbox service (`rlep serve sandbox`): `SandboxClient(address).run(code, caller)` answers
as `Sandbox.run` does, so the tool loop takes either (`ServiceClients.run_code`)."""

from __future__ import annotations

import json

import grpc

from rlep.common.grpc_channel import make_channel
from rlep.common.grpc_retry import call_with_retry
from rlep.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlep.services.sandbox.types import ToolResult

# A call is its wait for a slot (the server's max_wait_s, 60 s by default) and its run (wall_seconds, 10 s).
DEFAULT_TIMEOUT_S = 120.0


def result_from_proto(reply: sandbox_pb2.RunResponse) -> ToolResult:
    return ToolResult(
        reply.status,  # type: ignore[arg-type]  # the server's Status
        reply.exit_code if reply.HasField("exit_code") else None,
        reply.signal if reply.HasField("signal") else None,
        reply.stdout,
        reply.stderr,
        reply.truncated,
        reply.duration_s,
        reply.isolation,
        reply.detail,
        reply.cached,
    )


class SandboxClient:
    def __init__(
        self, address: str, token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, outage_s: float = 0.0
    ):
        """`outage_s`: how long a call keeps retrying a server that does not answer (call_with_retry)."""
        self._channel = make_channel(address, token)
        self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)
        self._timeout_s, self._outage_s = timeout_s, outage_s

    def run(self, code: str, caller: str = "") -> ToolResult:
        """ValueError for code the server refuses (INVALID_ARGUMENT), as `Sandbox.run` raises it; a call that got no
        slot in time is answered `sandbox_failure` (nothing ran), not raised: one busy moment must not fail a step."""
        request = sandbox_pb2.RunRequest(code=code, caller=caller)
        try:
            reply = call_with_retry(self._stub.Run, request, self._timeout_s, attempts=1, outage_s=self._outage_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(err.details()) from None
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return ToolResult("sandbox_failure", None, None, "", "", False, 0.0, "none", f"no slot: {err.details()}")
        return result_from_proto(reply)

    def describe(self) -> dict:
        """The service's `SandboxConfig.environment()`: what its calls' outputs depend on."""
        reply = call_with_retry(self._stub.Describe, sandbox_pb2.DescribeRequest(), 30.0, outage_s=self._outage_s)
        return json.loads(reply.environment_json)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
