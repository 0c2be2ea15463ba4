"""Rollout worker logic without gRPC: a Generate request's checks (sampling limits, prompts -> token ids)
and weight intake (header checks, staging and hashing a streamed payload, shared files, broadcast manifests).

vLLM validates `SamplingParams` when it builds them and raises on values it refuses (temperature
above 2, greedy sampling with n > 1, ...). Built on the engine thread, such a request would kill
that thread and wedge the replica, so vLLM's limits on these options are checked here, in the RPC
thread, with a message naming the field and the limit; `RolloutEngine.submit` then builds the
`SamplingParams` in the caller's thread as well, so anything vLLM refuses on top of this is still the
caller's INVALID_ARGUMENT, never the engine's problem.

Every check raises ValueError (`WeightError` for weights) with a message for the caller; server.py
turns them into INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rlep.common.files import file_digest
from rlep.rollout.v1 import rollout_pb2
from rlep.services.rollout.config import RolloutConfig
from rlep.services.rollout.types import MAX_TEMPERATURE, Sampling, greedy_problem
from rlep.services.weights.broadcast import DEFAULT_TIMEOUT_S, BroadcastGroup, manifest_bytes, manifest_digest
from rlep.services.weights.payload import (
    DIGEST_ALGORITHMS,
    SAFETENSORS_NAMES,
    TensorInfo,
    WeightError,
    WeightSpec,
    new_hasher,
    read_header,
)
from rlep.services.weights.staging import PUSH_PREFIX, WORKER_PREFIX, staged_file

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
CHAT_ROLES = ("system", "user", "assistant")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # matched whole (fullmatch): `$` would let a trailing newline through
DIGEST_NAMES = {enum: name for name, enum in DIGEST_ALGORITHMS.items()}
# A payload is the tensors plus a JSON header; the header of a big model stays well under this.
HEADER_SLACK_BYTES = 16 * 1024 * 1024
# A broadcast's communicator (unspecified: NCCL, what senders meant before the field existed).
BROADCAST_BACKENDS = {
    rollout_pb2.BROADCAST_BACKEND_UNSPECIFIED: "nccl",
    rollout_pb2.NCCL: "nccl",
    rollout_pb2.GLOO: "gloo",
}
MAX_BROADCAST_TIMEOUT_S = 3600.0  # what the sender's config allows


# -- Generate ----------------------------------------------------------------------------------
def sampling_from_request(request: rollout_pb2.GenerateRequest, config: RolloutConfig) -> Sampling:
    """The request's `Sampling`, or ValueError naming the field and its limit."""
    s = request.sampling
    count = len(request.prompts)
    if count == 0:
        raise ValueError("no prompts")
    if count > config.max_prompts_per_request:
        raise ValueError(f"{count} prompts, over the limit of {config.max_prompts_per_request}; split the request")
    if not 1 <= s.n <= config.max_n:
        raise ValueError(f"sampling.n must be in [1, {config.max_n}], got {s.n}")
    if count * s.n > config.max_samples_per_request:
        raise ValueError(
            f"{count} prompts x n={s.n} samples, over the limit of {config.max_samples_per_request}; split it"
        )
    if not (math.isfinite(s.temperature) and 0 <= s.temperature <= MAX_TEMPERATURE):
        raise ValueError(f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {s.temperature}")
    if problem := greedy_problem(s.n, s.temperature):
        raise ValueError(problem)
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise ValueError(f"sampling.top_p must be in (0, 1] (0 = 1.0), got {s.top_p}")
    if s.top_k < 0:
        raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {s.top_k}")
    if s.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
    if len(s.stop) > MAX_STOP_STRINGS or any(not 0 < len(stop) <= MAX_STOP_CHARS for stop in s.stop):
        raise ValueError(
            f"sampling.stop takes at most {MAX_STOP_STRINGS} non-empty strings of up to {MAX_STOP_CHARS} characters"
        )
    return Sampling(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        stop=tuple(s.stop),
        seed=s.seed if s.HasField("seed") else None,
    )


class PromptEncoder:
    """Turns a request's prompts (token ids, chat messages or text) into token ids the model can take."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int):
        self._tokenizer, self._vocab_size, self._max_model_len = tokenizer, vocab_size, max_model_len
        self._lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads

    def encode_all(self, prompts: Sequence[rollout_pb2.Prompt], max_tokens: int) -> list[list[int]]:
        """Token ids per prompt; ValueError when one is malformed or, with `max_tokens`, too long."""
        encoded = [self.encode(i, p) for i, p in enumerate(prompts)]
        for i, ids in enumerate(encoded):
            if len(ids) + max_tokens > self._max_model_len:
                raise ValueError(
                    f"prompts[{i}]: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed "
                    f"the model length {self._max_model_len}"
                )
        return encoded

    def encode(self, index: int, prompt: rollout_pb2.Prompt) -> list[int]:
        kind = prompt.WhichOneof("kind")
        if kind == "tokens":
            ids = list(prompt.tokens.token_ids)
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            if bad:
                raise ValueError(f"prompts[{index}]: token id {bad[0]} outside the vocabulary [0, {self._vocab_size})")
        elif kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
            if not messages:
                raise ValueError(f"prompts[{index}]: chat prompt without messages")
            for m in messages:
                if m["role"] not in CHAT_ROLES:
                    raise ValueError(f"prompts[{index}]: unknown role {m['role']!r}")
            with self._lock:
                text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = self._tokenizer.encode(text, add_special_tokens=False)
        elif kind == "text":
            with self._lock:
                ids = self._tokenizer.encode(prompt.text, add_special_tokens=False)
        else:
            raise ValueError(f"prompts[{index}]: set one of chat, tokens or text")
        if not ids:
            raise ValueError(f"prompts[{index}] is empty")
        return ids


# -- UpdateWeights -----------------------------------------------------------------------------
def digest_problem(header: rollout_pb2.WeightHeader) -> str | None:
    """Why a header's digest fields are refused, or None."""
    if header.digest_algorithm == rollout_pb2.DIGEST_ALGORITHM_UNSPECIFIED:
        if not SHA256_HEX.fullmatch(header.sha256):  # an older client's header: sha256 only
            return "header.sha256 must be 64 lowercase hex digits (or set digest_algorithm and digest)"
        return None
    if header.digest_algorithm not in DIGEST_NAMES:
        known = ", ".join(rollout_pb2.DigestAlgorithm.Name(e) for e in DIGEST_NAMES)
        return f"unsupported header.digest_algorithm {header.digest_algorithm} (this worker knows {known})"
    digits = new_hasher(DIGEST_NAMES[header.digest_algorithm]).digest_size * 2
    if not re.fullmatch(f"[0-9a-f]{{{digits}}}", header.digest):
        name = rollout_pb2.DigestAlgorithm.Name(header.digest_algorithm)
        return f"header.digest must be {digits} lowercase hex digits for {name}"
    return None


def payload_digest(header: rollout_pb2.WeightHeader) -> tuple[str, str]:
    """The algorithm and hex digest a (checked) header promises: `digest`, or an older client's `sha256`."""
    if header.digest_algorithm == rollout_pb2.DIGEST_ALGORITHM_UNSPECIFIED:
        return "sha256", header.sha256
    return DIGEST_NAMES[header.digest_algorithm], header.digest


class WeightIntake:
    """Checks a pushed payload against the served model before the engine sees it.

    A streamed payload is staged in a locked file (services/weights/staging.py) and hashed on arrival
    (the header's `digest_algorithm`; an older client's `sha256` is still checked);
    a shared file must be a push payload directly in one of `shared_dirs`; a broadcast push is checked by its manifest.
    """

    def __init__(
        self,
        model_path: str | Path,
        staging_dir: str | Path,
        shared_dirs: Sequence[str | Path],
        engine_dtype: str | None = None,
    ):
        # Tensors may come in the checkpoint's dtype or in the engine's (`engine_dtype`, torch's name).
        spec = WeightSpec.from_checkpoint(Path(model_path))
        self._spec = dataclasses.replace(spec, engine_dtype=SAFETENSORS_NAMES.get(engine_dtype or ""))
        self._max_payload = sum(t.nbytes for t in self._spec.tensors.values()) * 2 + HEADER_SLACK_BYTES
        self._staging_dir, self._shared_dirs = staging_dir, shared_dirs

    def header_problem(self, header: rollout_pb2.WeightHeader) -> str | None:
        """Why a push's header is refused, or None."""
        if header.format not in (rollout_pb2.WEIGHT_FORMAT_UNSPECIFIED, rollout_pb2.SAFETENSORS):
            return f"unsupported weight format {header.format}"
        if problem := digest_problem(header):
            return problem
        if not 0 < header.total_bytes <= self._max_payload:
            return f"header.total_bytes {header.total_bytes} is not a plausible size for this model"
        return None

    def receive(
        self, chunks: Iterator[rollout_pb2.WeightChunk], header: rollout_pb2.WeightHeader, staging: ExitStack
    ) -> Path:
        """The checked payload's path: its digest and tensors match `header` and the model. A streamed
        payload's file lives until `staging` closes; a shared file stays its sender's."""
        algorithm, expected = payload_digest(header)
        first = next(chunks, None)
        if first is not None and first.WhichOneof("kind") == "shared_file":
            if next(chunks, None) is not None:
                raise WeightError("nothing may follow a shared_file chunk")
            path = self._shared_file(first.shared_file, header.total_bytes)
            digest = file_digest(path, algorithm)
        else:
            path, digest = self._stream(first, chunks, header.total_bytes, algorithm, staging)
        if digest != expected:
            raise WeightError(f"{algorithm} of the payload does not match the header: corrupted or changed on its way")
        self._spec.check(read_header(path))
        return path

    def _stream(self, first, chunks, total_bytes: int, algorithm: str, staging: ExitStack) -> tuple[Path, str]:
        fd, staged = staging.enter_context(staged_file(self._staging_dir, WORKER_PREFIX))
        written = 0
        digest = new_hasher(algorithm)  # hashed on arrival: no second pass over the file
        with open(fd, "wb", closefd=False) as out:  # the descriptor holds the lock: it stays open
            chunk = first
            while chunk is not None:
                if chunk.WhichOneof("kind") != "data":
                    raise WeightError("after the header, send only data chunks (or one shared_file)")
                data = chunk.data  # a view of the received bytes (services/weights/wire.py), or a copy from protobuf
                written += len(data)
                if written > total_bytes:
                    raise WeightError(f"more bytes than header.total_bytes ({total_bytes})")
                out.write(data)
                digest.update(data)
                chunk = next(chunks, None)
        if written != total_bytes:
            raise WeightError(f"received {written} bytes, header.total_bytes says {total_bytes}")
        return staged, digest.hexdigest()

    def _shared_file(self, name: str, total_bytes: int) -> Path:
        """The push payload `name` names. Only a sender's payload file qualifies (`rlep-push-*.safetensors` directly
        in a shared folder, links resolved), and every refusal reads the same: a caller learns nothing of other
        files (whether a path exists, or its size)."""
        path = Path(name).resolve()
        allowed = [Path(d).resolve() for d in self._shared_dirs]
        is_payload = path.parent in allowed and path.name.startswith(PUSH_PREFIX) and path.suffix == ".safetensors"
        if not (is_payload and path.is_file() and path.stat().st_size == total_bytes):
            raise WeightError(
                f"shared_file must name a payload file of header.total_bytes bytes, {PUSH_PREFIX}*.safetensors "
                f"directly in one of {[str(d) for d in allowed]}"
            )
        return path

    def broadcast_entries(
        self,
        header: rollout_pb2.WeightHeader,
        broadcast: rollout_pb2.NcclBroadcast,
        rest: Iterator[rollout_pb2.WeightChunk],
    ) -> tuple[BroadcastGroup, list[tuple[str, TensorInfo]]]:
        """The group a broadcast push names and the tensors it will send, checked against `header` and the model."""
        if next(rest, None) is not None:
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
        if broadcast.backend not in BROADCAST_BACKENDS:
            raise WeightError(f"nccl_broadcast.backend {broadcast.backend} is not NCCL or GLOO")
        if not (math.isfinite(broadcast.timeout_s) and 0 <= broadcast.timeout_s <= MAX_BROADCAST_TIMEOUT_S):
            raise WeightError(f"nccl_broadcast.timeout_s must be in [0, {MAX_BROADCAST_TIMEOUT_S:g}] (0 = default)")
        if broadcast.bucket_bytes < 0:
            raise WeightError("nccl_broadcast.bucket_bytes must be >= 0 (0 = default)")
        group = BroadcastGroup(
            broadcast.master_address,
            broadcast.master_port,
            broadcast.world_size,
            BROADCAST_BACKENDS[broadcast.backend],
            broadcast.timeout_s or DEFAULT_TIMEOUT_S,
        )
        return group, entries
