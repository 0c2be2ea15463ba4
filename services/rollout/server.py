"""gRPC adapter of a rollout worker: proto <-> `RolloutEngine` and `requests`, error codes, metrics.

Request checks, prompt tokenisation and weight intake live in `requests.py`; this file maps their
ValueError / WeightError to INVALID_ARGUMENT and the engine's errors to their codes. Every call is
counted by method and code by the server's `StatusCountInterceptor` (`rlep_rollout_requests_total`).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack

import grpc
from prometheus_client import CollectorRegistry

from rlep.common.grpc_validation import reject_unknown_fields
from rlep.common.metrics import MetricFactory
from rlep.common.wire import FINISH_TO_PROTO
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.rollout.broadcast_receiver import BroadcastFailed, broadcast_problem
from rlep.services.rollout.config import RolloutConfig
from rlep.services.rollout.engine import (
    CallAbandoned,
    EngineUnavailable,
    RolloutEngine,
    VersionError,
)
from rlep.services.rollout.requests import PromptEncoder, WeightIntake, sampling_from_request
from rlep.services.rollout.types import Generation
from rlep.services.weights.broadcast import DEFAULT_BUCKET_BYTES
from rlep.services.weights.payload import WeightError
from rlep.services.weights.wire import decode_chunk

log = logging.getLogger(__name__)

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"]


class RolloutMetrics:
    """The rollout worker's Prometheus series (`rlep_rollout_*`)."""

    def __init__(self, registry: CollectorRegistry):
        m = MetricFactory(registry)
        self.requests = m.counter(  # counted by the server's StatusCountInterceptor
            "rlep_rollout_requests_total", "RPCs, by method and status code", ["method", "code"]
        )
        self.generated_tokens = m.counter("rlep_rollout_generated_tokens_total", "Tokens generated (rate() = tokens/s)")
        self.tokens_per_second = m.gauge(
            "rlep_rollout_batch_tokens_per_second", "Generated tokens/s of the last engine batch"
        )
        self.in_flight = m.gauge("rlep_rollout_requests_in_flight", "Generate calls being served")
        self.queue_seconds = m.histogram(
            "rlep_rollout_queue_seconds",
            "Time a Generate call waited for the engine",
            (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.generate_seconds = m.histogram(
            "rlep_rollout_generate_seconds",
            "Latency of a Generate call",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.weight_version = m.gauge("rlep_rollout_weight_version", "Policy version being served")
        self.receive_peak_bytes = m.gauge(
            "rlep_rollout_weight_receive_peak_bytes",
            "Most bytes of received tensors a worker held at once during the last broadcast push",
        )
        self.update_seconds = m.histogram(
            "rlep_rollout_weight_update_seconds",
            "Duration of an UpdateWeights call (receive + check + load)",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    # Data chunks are viewed in the received bytes, not copied through protobuf (services/weights/wire.py).
    request_parsers = {"UpdateWeights": decode_chunk}

    def __init__(self, engine: RolloutEngine, config: RolloutConfig, metrics: RolloutMetrics):
        self._engine, self._config, self._metrics = engine, config, metrics
        self._prompts = PromptEncoder(engine.tokenizer, engine.vocab_size, engine.max_model_len)
        self._intake = WeightIntake(engine.model_path, config.staging_dir, config.shared_dirs, engine.dtype)
        self._replica_id = config.replica_id or f"{socket.gethostname()}:{os.getpid()}"
        metrics.weight_version.set(engine.version)

    # -- Generate ----------------------------------------------------------------------------
    def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext):
        started = time.perf_counter()
        self._metrics.in_flight.inc()
        try:
            return self._generate(request, context)
        finally:
            self._metrics.in_flight.dec()
            self._metrics.generate_seconds.observe(time.perf_counter() - started)

    def _generate(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext):
        reject_unknown_fields(request, context)
        try:
            sampling = sampling_from_request(request, self._config)
            prompts = self._prompts.encode_all(request.prompts, sampling.max_tokens)
            job = self._engine.submit(prompts, sampling, timeout_s=context.time_remaining())
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except EngineUnavailable as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        # A client that cancels or disconnects ends the call: its vLLM requests are aborted at the next step.
        if not context.add_callback(job.cancel):
            job.cancel()
        try:
            generation = job.result(context.time_remaining())
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "generation did not finish within the deadline")
        except CallAbandoned as err:
            context.abort(grpc.StatusCode.CANCELLED, str(err))
        except EngineUnavailable as err:  # the client retries the shard on another replica
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except ValueError as err:  # vLLM refused a prompt our checks let through
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Exception as err:
            log.exception("Generate failed")
            context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {err}")
        self._record(generation)
        return self._response(prompts, generation)

    def _record(self, generation: Generation) -> None:
        self._metrics.queue_seconds.observe(generation.queue_seconds)
        self._metrics.generated_tokens.inc(generation.generated_tokens)
        if generation.engine_seconds > 0:
            self._metrics.tokens_per_second.set(generation.generated_tokens / generation.engine_seconds)

    def _response(self, prompts: list[list[int]], generation: Generation) -> rollout_pb2.GenerateResponse:
        response = rollout_pb2.GenerateResponse(policy_version=generation.policy_version)
        for ids, samples in zip(prompts, generation.samples, strict=True):
            completion = response.completions.add(prompt_token_ids=ids)
            for s in samples:
                completion.samples.add(
                    token_ids=s.token_ids,
                    text=s.text,
                    logprobs=s.logprobs,
                    finish_reason=FINISH_TO_PROTO[s.finish_reason],
                    policy_version=s.policy_version,
                )
        return response

    # -- UpdateWeights -----------------------------------------------------------------------
    def UpdateWeights(self, chunks: Iterable[rollout_pb2.WeightChunk], context: grpc.ServicerContext):
        started = time.perf_counter()
        try:
            return self._update_weights(iter(chunks), context, started)
        finally:
            self._metrics.update_seconds.observe(time.perf_counter() - started)

    def _update_weights(self, chunks: Iterator[rollout_pb2.WeightChunk], context: grpc.ServicerContext, started):
        first = next(chunks, None)
        if first is None or first.WhichOneof("kind") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first WeightChunk must be the header")
        header = first.header
        reject_unknown_fields(first, context)
        if problem := self._intake.header_problem(header):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if header.version <= self._engine.version:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"version {header.version} is not newer than the current version {self._engine.version}",
            )
        second = next(chunks, None)
        if second is not None and second.WhichOneof("kind") == "nccl_broadcast":
            return self._update_by_broadcast(header, second.nccl_broadcast, chunks, context)
        chunks = itertools.chain([second] if second is not None else [], chunks)
        with ExitStack() as staging:  # a streamed payload's file lives until the load is done
            try:
                path = self._intake.receive(chunks, header, staging)
            except WeightError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            received = time.perf_counter() - started
            try:
                load_seconds = self._engine.load_weights(path, header.version)
            except VersionError as err:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            except EngineUnavailable as err:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        self._metrics.weight_version.set(self._engine.version)
        return rollout_pb2.UpdateWeightsResponse(
            version=header.version, receive_seconds=received, load_seconds=load_seconds
        )

    def _update_by_broadcast(self, header, broadcast: rollout_pb2.NcclBroadcast, chunks, context):
        """Check the manifest, then join the learner's group and receive the tensors (NCCL or gloo)."""
        started = time.perf_counter()
        try:
            group, entries = self._intake.broadcast_entries(header, broadcast, chunks)
        except WeightError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if problem := broadcast_problem(group.backend):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        try:
            bucket_bytes = broadcast.bucket_bytes or DEFAULT_BUCKET_BYTES
            receipt = self._engine.receive_broadcast(
                group, broadcast.rank_offset, entries, header.version, bucket_bytes
            )
        except VersionError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except BroadcastFailed as err:  # a peer died or timed out; the learner's next push forms a new group
            log.warning("%s", err)
            context.abort(grpc.StatusCode.ABORTED, str(err))
        except EngineUnavailable as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        self._metrics.weight_version.set(self._engine.version)
        self._metrics.receive_peak_bytes.set(receipt.peak_bytes)
        return rollout_pb2.UpdateWeightsResponse(
            version=header.version,
            receive_seconds=time.perf_counter() - started - receipt.load_seconds,
            load_seconds=receipt.load_seconds,
            receive_peak_bytes=receipt.peak_bytes,
        )

    # -- GetStatus ---------------------------------------------------------------------------
    def GetStatus(self, request: rollout_pb2.GetStatusRequest, context: grpc.ServicerContext):
        if (reason := self._engine.failure) is not None:  # clients then count this replica as down
            context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        return rollout_pb2.RolloutStatus(
            policy_version=self._engine.version,
            model=self._engine.model_path,
            requests_in_flight=int(self._metrics.in_flight._value.get()),
            max_model_len=self._engine.max_model_len,
            vocab_size=self._engine.vocab_size,
            replica_id=self._replica_id,
            generated_tokens=self._engine.generated_tokens,
            pid=os.getpid(),
            dtype=self._engine.dtype,
            logprobs_mode=self._config.engine.logprobs_mode,
            workers=self._engine.workers,
        )
