"""gRPC adapter of a rollout worker: proto <-> `RolloutEngine`, request limits, weight intake, metrics."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlep.common.files import sha256_file
from rlep.common.grpc_utils import check_request_size, reject_unknown_fields
from rlep.common.wire import FINISH_TO_PROTO
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.rollout.config import RolloutConfig
from rlep.services.rollout.engine import CallAbandoned, EngineUnavailable, RolloutEngine, VersionError
from rlep.services.rollout.sampling import sampling_from_request
from rlep.services.rollout.types import Generation
from rlep.services.weights.nccl import BroadcastGroup, manifest_bytes, manifest_digest
from rlep.services.weights.payload import TensorInfo, WeightError, WeightSpec, read_header
from rlep.services.weights.staging import WORKER_PREFIX, staged_file

log = logging.getLogger(__name__)

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"]
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# A payload is the tensors plus a JSON header; the header of a big model stays well under this.
HEADER_SLACK_BYTES = 16 * 1024 * 1024


class RolloutMetrics:
    """The rollout worker's Prometheus series (`rlep_rollout_*`)."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "rlep_rollout_requests_total", "RPCs, by method and status code", ["method", "code"], registry=registry
        )
        self.generated_tokens = Counter(
            "rlep_rollout_generated_tokens_total", "Tokens generated (rate() = tokens/s)", registry=registry
        )
        self.tokens_per_second = Gauge(
            "rlep_rollout_batch_tokens_per_second", "Generated tokens/s of the last engine batch", registry=registry
        )
        self.in_flight = Gauge("rlep_rollout_requests_in_flight", "Generate calls being served", registry=registry)
        self.queue_seconds = Histogram(
            "rlep_rollout_queue_seconds",
            "Time a Generate call waited for the engine",
            registry=registry,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.generate_seconds = Histogram(
            "rlep_rollout_generate_seconds",
            "Latency of a Generate call",
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.weight_version = Gauge("rlep_rollout_weight_version", "Policy version being served", registry=registry)
        self.update_seconds = Histogram(
            "rlep_rollout_weight_update_seconds",
            "Duration of an UpdateWeights call (receive + check + load)",
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, engine: RolloutEngine, config: RolloutConfig, metrics: RolloutMetrics):
        self._engine, self._config, self._metrics = engine, config, metrics
        self._spec = WeightSpec.from_checkpoint(Path(engine.model_path))
        self._max_payload = sum(t.nbytes for t in self._spec.tensors.values()) * 2 + HEADER_SLACK_BYTES
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self._replica_id = config.replica_id or f"{socket.gethostname()}:{os.getpid()}"
        metrics.weight_version.set(engine.version)

    @contextmanager
    def _observe(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        code = grpc.StatusCode.OK
        try:
            yield
        except Exception:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        finally:
            self._metrics.requests.labels(method, code.name).inc()

    # -- Generate ----------------------------------------------------------------------------
    def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext):
        started = time.perf_counter()
        self._metrics.in_flight.inc()
        try:
            with self._observe("Generate", context):
                return self._generate(request, context)
        finally:
            self._metrics.in_flight.dec()
            self._metrics.generate_seconds.observe(time.perf_counter() - started)

    def _generate(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext):
        check_request_size(request, context, self._config.server.max_request_bytes)
        reject_unknown_fields(request, context)
        try:
            sampling = sampling_from_request(request, self._config)
            prompts = [self._prompt_ids(i, p) for i, p in enumerate(request.prompts)]
            for i, ids in enumerate(prompts):
                if len(ids) + sampling.max_tokens > self._engine.max_model_len:
                    raise ValueError(
                        f"prompts[{i}]: {len(ids)} prompt tokens + max_tokens {sampling.max_tokens} exceed "
                        f"the model length {self._engine.max_model_len}"
                    )
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

    def _prompt_ids(self, index: int, prompt: rollout_pb2.Prompt) -> list[int]:
        kind = prompt.WhichOneof("kind")
        tokenizer = self._engine.tokenizer
        if kind == "tokens":
            ids = list(prompt.tokens.token_ids)
            bad = [t for t in ids if not 0 <= t < self._engine.vocab_size]
            if bad:
                raise ValueError(
                    f"prompts[{index}]: token id {bad[0]} outside the vocabulary [0, {self._engine.vocab_size})"
                )
        elif kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
            if not messages:
                raise ValueError(f"prompts[{index}]: chat prompt without messages")
            for m in messages:
                if m["role"] not in ("system", "user", "assistant"):
                    raise ValueError(f"prompts[{index}]: unknown role {m['role']!r}")
            with self._tokenizer_lock:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tokenizer.encode(text, add_special_tokens=False)
        elif kind == "text":
            with self._tokenizer_lock:
                ids = tokenizer.encode(prompt.text, add_special_tokens=False)
        else:
            raise ValueError(f"prompts[{index}]: set one of chat, tokens or text")
        if not ids:
            raise ValueError(f"prompts[{index}] is empty")
        return ids

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
            with self._observe("UpdateWeights", context):
                return self._update_weights(iter(chunks), context, started)
        finally:
            self._metrics.update_seconds.observe(time.perf_counter() - started)

    def _update_weights(self, chunks: Iterator[rollout_pb2.WeightChunk], context: grpc.ServicerContext, started):
        first = next(chunks, None)
        if first is None or first.WhichOneof("kind") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first WeightChunk must be the header")
        header = first.header
        reject_unknown_fields(first, context)
        problem = self._header_problem(header)
        if problem:
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
                path, digest = self._receive(chunks, header, staging)
                if digest != header.sha256:
                    raise WeightError("sha256 of the payload does not match the header")
                self._spec.check(read_header(path))
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
        """GPU path (not exercised by CI): check the manifest, then receive the tensors over NCCL."""
        started = time.perf_counter()
        try:
            if next(chunks, None) is not None:
                raise WeightError("nothing may follow an nccl_broadcast chunk")
            entries = [(t.name, TensorInfo(t.dtype, tuple(t.shape))) for t in broadcast.tensors]
            if len({name for name, _ in entries}) != len(entries):
                raise WeightError("nccl_broadcast names a tensor twice")
            if manifest_digest(entries) != header.sha256:
                raise WeightError("sha256 of the manifest does not match the header")
            if manifest_bytes(entries) != header.total_bytes:
                raise WeightError(
                    f"the manifest holds {manifest_bytes(entries)} bytes, header.total_bytes says {header.total_bytes}"
                )
            self._spec.check(dict(entries))
            if not broadcast.master_address or not 0 < broadcast.master_port < 65536:
                raise WeightError("nccl_broadcast needs master_address and a master_port in 1..65535")
            if not 1 <= broadcast.rank_offset < broadcast.world_size:
                raise WeightError("nccl_broadcast needs 1 <= rank_offset < world_size (rank 0 is the learner)")
        except WeightError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not self._engine.supports_broadcast:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "weight broadcast over NCCL needs a GPU worker; this one runs on CPU (push with stream or shared_file)",
            )
        group = BroadcastGroup(broadcast.master_address, broadcast.master_port, broadcast.world_size)
        try:
            load_seconds = self._engine.receive_broadcast(group, broadcast.rank_offset, entries, header.version)
        except VersionError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        self._metrics.weight_version.set(self._engine.version)
        return rollout_pb2.UpdateWeightsResponse(
            version=header.version,
            receive_seconds=time.perf_counter() - started - load_seconds,
            load_seconds=load_seconds,
        )

    def _header_problem(self, header: rollout_pb2.WeightHeader) -> str | None:
        if header.format not in (rollout_pb2.WEIGHT_FORMAT_UNSPECIFIED, rollout_pb2.SAFETENSORS):
            return f"unsupported weight format {header.format}"
        if not SHA256_HEX.match(header.sha256):
            return "header.sha256 must be 64 lowercase hex digits"
        if not 0 < header.total_bytes <= self._max_payload:
            return f"header.total_bytes {header.total_bytes} is not a plausible size for this model"
        return None

    def _receive(self, chunks, header, staging: ExitStack) -> tuple[Path, str]:
        """The payload's path and its sha256. A streamed payload is staged in a locked file that `staging`
        removes (services/weights/staging.py); a shared file stays its sender's."""
        first = next(chunks, None)
        if first is not None and first.WhichOneof("kind") == "shared_file":
            if next(chunks, None) is not None:
                raise WeightError("nothing may follow a shared_file chunk")
            path = self._shared_file(first.shared_file, header.total_bytes)
            return path, sha256_file(path)
        fd, staged = staging.enter_context(staged_file(self._config.staging_dir, WORKER_PREFIX))
        written = 0
        digest = hashlib.sha256()  # hashed on arrival: no second pass over the file
        with open(fd, "wb", closefd=False) as out:  # the descriptor holds the lock: it stays open
            chunk = first
            while chunk is not None:
                if chunk.WhichOneof("kind") != "data":
                    raise WeightError("after the header, send only data chunks (or one shared_file)")
                written += len(chunk.data)
                if written > header.total_bytes:
                    raise WeightError(f"more bytes than header.total_bytes ({header.total_bytes})")
                out.write(chunk.data)
                digest.update(chunk.data)
                chunk = next(chunks, None)
        if written != header.total_bytes:
            raise WeightError(f"received {written} bytes, header.total_bytes says {header.total_bytes}")
        return staged, digest.hexdigest()

    def _shared_file(self, name: str, total_bytes: int) -> Path:
        path = Path(name).resolve()
        allowed = [Path(d).resolve() for d in self._config.shared_dirs]
        if not any(path.is_relative_to(d) for d in allowed):
            raise WeightError(f"shared_file must be under one of {[str(d) for d in allowed]}")
        if not path.is_file():
            raise WeightError(f"shared_file {name} does not exist on this host")
        if path.stat().st_size != total_bytes:
            raise WeightError(f"shared_file holds {path.stat().st_size} bytes, header.total_bytes says {total_bytes}")
        return path

    # -- GetStatus ---------------------------------------------------------------------------
    def GetStatus(self, request: rollout_pb2.GetStatusRequest, context: grpc.ServicerContext):
        with self._observe("GetStatus", context):
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
            )
