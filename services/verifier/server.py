"""gRPC adapter of the verifier: proto <-> `Scorers` (routing by data_source over the worker pool and HTTP
scorers), limits, metrics. No verification logic here.

Every call's work is bounded and stops with the call: it waits for the caller's deadline or the
server's `request_timeout_s`, whichever comes first, and when the call ends early (deadline, limit,
or the client cancelling) its unchecked items are dropped from the pool's queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError

import grpc
from prometheus_client import CollectorRegistry

from rlep.common.metrics import MetricFactory
from rlep.common.types import Verdict
from rlep.common.wire import VERDICT_TO_PROTO
from rlep.services.verifier.client import ScoredItem
from rlep.services.verifier.config import VerifierConfig
from rlep.services.verifier.routing import DEFAULT_LABEL, Scorers
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc

SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]
CACHES = ("verdict", "in_flight", "gold", "answer")


class VerifierMetrics:
    """The verifier's Prometheus series (`rlep_verifier_*`)."""

    def __init__(self, registry: CollectorRegistry, scorers: Sequence[str] = (DEFAULT_LABEL,)):
        m = MetricFactory(registry)
        verdicts = [verdict.value for verdict in Verdict]
        self.items = m.counter(
            "rlep_verifier_items_total",
            "Responses checked, by verdict and scorer (the data_source key that routed them, or default)",
            ["verdict", "scorer"],
            [(verdict, scorer) for verdict in verdicts for scorer in scorers],
        )
        self.requests = m.counter(  # counted by the server's StatusCountInterceptor
            "rlep_verifier_requests_total",
            "Verify calls, by status code",
            ["code"],
            zero=("OK", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED"),
        )
        self.request_seconds = m.histogram(
            "rlep_verifier_request_seconds",
            "Latency of a Verify call",
            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.item_seconds = m.histogram(
            "rlep_verifier_item_seconds",
            "Worker time spent on one response",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.worker_restarts = m.counter(
            "rlep_verifier_worker_restarts_total",
            "Workers killed and replaced, by reason",
            ["reason"],
            ("timeout", "crash"),
        )
        self.items_dropped = m.counter(
            "rlep_verifier_items_dropped_total",
            "Items never checked because their call was cancelled or ran out of time",
        )
        self.cache_hits = m.counter(
            "rlep_verifier_cache_hits_total",
            "Lookups answered without the work: verdict (server's verdict cache), in_flight (joined an identical"
            " item's check), gold / answer (a worker's parse caches)",
            ["cache"],
            CACHES,
        )
        self.cache_misses = m.counter(
            "rlep_verifier_cache_misses_total",
            "Lookups that found nothing: verdict (includes those that then joined a check in flight), gold, answer",
            ["cache"],
            ("verdict", "gold", "answer"),
        )
        self.items_in_flight = m.gauge("rlep_verifier_items_in_flight", "Items submitted and not yet answered")
        self.workers = m.gauge(
            "rlep_verifier_workers", "Worker processes in the pool (num_workers; the express worker is one more)"
        )

    def count_cache_lookups(self, cache: str, hit: bool, count: int) -> None:
        """The pool's `on_cache` callback."""
        if count:
            (self.cache_hits if hit else self.cache_misses).labels(cache).inc(count)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, scorers: Scorers, config: VerifierConfig, metrics: VerifierMetrics):
        self._scorers, self._config, self._metrics = scorers, config, metrics
        self._call_slots = threading.BoundedSemaphore(config.call_slots)

    def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.ServicerContext) -> verifier_pb2.VerifyResponse:
        started = time.perf_counter()
        if not self._call_slots.acquire(blocking=False):  # a thread must stay free for the health check
            # UNAVAILABLE, not RESOURCE_EXHAUSTED: a transient overload, which clients retry with backoff.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"verifier busy: {self._config.call_slots} Verify calls in flight (max_calls_in_flight); retry shortly",
            )
        try:
            return self._verify(request, context)
        finally:
            self._call_slots.release()
            self._metrics.request_seconds.observe(time.perf_counter() - started)

    def _verify(
        self, request: verifier_pb2.VerifyRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.VerifyResponse:
        count = len(request.items)
        if count > self._config.max_items_per_request:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{count} items in one request, over the limit of {self._config.max_items_per_request}; split it",
            )
        # Without a client deadline time_remaining() is ~1e18 s (more than a wait can take): cap it.
        limit_s = self._config.request_timeout_s
        remaining_s = context.time_remaining()
        own_limit = remaining_s is None or remaining_s >= limit_s
        try:
            batch = self._scorers.start(
                [ScoredItem(item.response, item.ground_truth, item.data_source, item.extra) for item in request.items]
            )
        except ValueError as err:  # an item's extra is not a JSON object
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not context.add_callback(batch.cancel):  # runs when the call ends, however it ends
            batch.cancel()
        self._metrics.items_in_flight.inc(count)
        try:
            results = batch.wait(limit_s if own_limit else remaining_s)
        except TimeoutError as err:
            if own_limit:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"not finished within the server's limit of {limit_s:g} s per call (request_timeout_s): {err};"
                    " send fewer items per call",
                )
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
        except CancelledError as err:
            context.abort(grpc.StatusCode.CANCELLED, str(err))
        finally:
            batch.cancel()  # a no-op when every item is answered
            self._metrics.items_in_flight.dec(count)
        out = verifier_pb2.VerifyResponse()
        for scored in results:
            result = scored.result
            self._metrics.items.labels(result.verdict.value, scored.scorer).inc()
            self._metrics.item_seconds.observe(result.seconds)
            out.results.add(
                reward=scored.reward,
                verdict=VERDICT_TO_PROTO[result.verdict],
                extracted_answer=result.extracted_answer,
                seconds=result.seconds,
                score=scored.score,
            )
        return out
