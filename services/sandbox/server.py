"""gRPC adapter of the sandbox (`rlep serve sandbox`): proto <-> `Sandbox.run`, the call bounds, metrics. No isolation
logic here (executor.py) and no scheduling (sandbox.py's fair slots).

Every call is bounded: at most `max_calls_in_flight` in the server (one more gets UNAVAILABLE at once, so the health
check keeps a thread), a wait for a slot of at most the caller's deadline or `max_wait_s`, ended when the caller
leaves, and a run within the sandbox's own CPU, wall-clock, memory and output limits.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import get_args

import grpc
from prometheus_client import CollectorRegistry

from rlep.common.metrics import MetricFactory
from rlep.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlep.services.sandbox.config import SandboxServiceConfig
from rlep.services.sandbox.sandbox import Sandbox, SlotTimeout
from rlep.services.sandbox.types import Status, ToolResult

SERVICE = sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"]
CALLER = re.compile(r"[A-Za-z0-9_.:/-]{0,128}")


class SandboxMetrics:
    """The sandbox service's Prometheus series (`rlep_sandbox_*`)."""

    def __init__(self, registry: CollectorRegistry):
        m = MetricFactory(registry)
        self.calls = m.counter(
            "rlep_sandbox_calls_total", "Calls answered, by the sandbox's status", ["status"], get_args(Status)
        )
        self.requests = m.counter(  # counted by the server's StatusCountInterceptor
            "rlep_sandbox_requests_total",
            "Run calls, by status code",
            ["code"],
            zero=("OK", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE"),
        )
        self.call_seconds = m.histogram(
            "rlep_sandbox_call_seconds",
            "Time of a Run call, the wait for a slot included",
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.cache_hits = m.counter("rlep_sandbox_cache_hits_total", "Calls answered from the result cache")
        self.in_flight = m.gauge("rlep_sandbox_calls_in_flight", "Run calls in the server, running or waiting")


def result_to_proto(result: ToolResult) -> sandbox_pb2.RunResponse:
    return sandbox_pb2.RunResponse(
        status=result.status,
        exit_code=result.exit_code,
        signal=result.signal,
        stdout=result.stdout,
        stderr=result.stderr,
        truncated=result.truncated,
        duration_s=result.duration_s,
        isolation=result.isolation,
        detail=result.detail,
        cached=result.cached,
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, sandbox: Sandbox, config: SandboxServiceConfig, metrics: SandboxMetrics):
        self._sandbox, self._config, self._metrics = sandbox, config, metrics
        self._call_slots = threading.BoundedSemaphore(config.call_slots)
        self._environment = config.sandbox.environment()

    def Run(self, request: sandbox_pb2.RunRequest, context: grpc.ServicerContext) -> sandbox_pb2.RunResponse:
        started = time.perf_counter()
        if not self._call_slots.acquire(blocking=False):  # a thread must stay free for the health check
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"sandbox busy: {self._config.call_slots} Run calls in the server (max_calls_in_flight); retry shortly",
            )
        self._metrics.in_flight.inc()
        try:
            return self._run(request, context)
        finally:
            self._metrics.in_flight.dec()
            self._call_slots.release()
            self._metrics.call_seconds.observe(time.perf_counter() - started)

    def Describe(
        self, request: sandbox_pb2.DescribeRequest, context: grpc.ServicerContext
    ) -> sandbox_pb2.DescribeResponse:
        return sandbox_pb2.DescribeResponse(environment_json=json.dumps(self._environment, sort_keys=True))

    def _run(self, request: sandbox_pb2.RunRequest, context: grpc.ServicerContext) -> sandbox_pb2.RunResponse:
        if not CALLER.fullmatch(request.caller):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"caller must match {CALLER.pattern}")
        remaining = context.time_remaining()
        wait_s = self._config.max_wait_s if remaining is None else min(remaining, self._config.max_wait_s)
        try:
            result = self._sandbox.run(
                request.code, request.caller, wait_s=wait_s, gone=lambda: not context.is_active()
            )
        except ValueError as err:  # code the sandbox refuses: over max_code_bytes, a NUL
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except SlotTimeout as err:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{err}; nothing ran")
        self._metrics.calls.labels(result.status).inc()
        if result.cached:
            self._metrics.cache_hits.inc()
        return result_to_proto(result)
