"""Weight payloads: safetensors files checked by name, shape, dtype and digest before any engine sees them.

A payload is one safetensors file holding a full state dict under the checkpoint's (HF) names.
Only the JSON header is read to validate it, so a bad push is refused before a tensor is loaded,
and nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rlep.common.files import HASH_BLOCK_BYTES, HASHERS
from rlep.rollout.v1 import rollout_pb2

HEADER_LIMIT_BYTES = 100 * 1024 * 1024  # safetensors' own cap on the JSON header

# The digest a push carries (rlep.common.files.HASHERS). It catches a payload corrupted, truncated or swapped on
# its way, not a forger: whoever can write the payload also writes the header beside it (the same authenticated
# call, or a 0600 file of the sender's), so a cryptographic hash would buy nothing. Each push hashes the payload
# twice (sender, worker); at 104M fp32 parameters sha256 took ~0.28 s a pass, xxh3_128 ~0.05 s (blake3 ~0.13 s).
PAYLOAD_DIGEST = "xxh3_128"
# The header's spelling of each algorithm (WeightHeader.digest_algorithm).
DIGEST_ALGORITHMS = {"sha256": rollout_pb2.SHA256, "xxh3_128": rollout_pb2.XXH3_128}
assert DIGEST_ALGORITHMS.keys() <= HASHERS.keys()


def new_hasher(algorithm: str):
    """A hashlib-style hasher (update, hexdigest) for one of `DIGEST_ALGORITHMS`."""
    return HASHERS[algorithm]()


class WeightError(ValueError):
    """A payload that does not fit the model; the message says what is wrong."""


# Bytes per element of the safetensors dtypes.
DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors spelling: F32, BF16, F16, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data (an unknown dtype counts 8 bytes an element: an upper bound)."""
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 8)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names -> dtype and shape, from a safetensors file's header (no tensor data read)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise WeightError(f"not a safetensors payload: {size} bytes")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(HEADER_LIMIT_BYTES, size - 8):
            raise WeightError(f"not a safetensors payload: header length {length} does not fit in {size} bytes")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise WeightError(f"not a safetensors payload: unreadable header ({err})") from err
    if not isinstance(header, dict):
        raise WeightError("not a safetensors payload: header is not an object")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            tensors[name] = TensorInfo(str(entry["dtype"]), tuple(int(d) for d in entry["shape"]))
        except (KeyError, TypeError, ValueError) as err:
            raise WeightError(f"not a safetensors payload: bad entry for {name!r}") from err
    return tensors


@dataclass(frozen=True)
class WeightSpec:
    """What a push must contain: the checkpoint's tensors, plus names the engine may ignore."""

    tensors: dict[str, TensorInfo]
    ignorable: frozenset[str] = frozenset()
    engine_dtype: str | None = None
    """The engine's dtype (safetensors spelling, e.g. BF16): a floating tensor may come in it instead of the
    checkpoint's, as the learner sends it (`weight_push.push_dtype`), since the engine holds it so anyway."""

    @classmethod
    def from_checkpoint(cls, model_dir: Path) -> WeightSpec:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise WeightError(f"no *.safetensors in {model_dir}")
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            tensors.update(read_header(file))
        config = json.loads((Path(model_dir) / "config.json").read_text())
        # A tied output layer shares the embedding: a full state_dict() carries it, the checkpoint does not.
        ignorable = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
        return cls(tensors, frozenset(ignorable - tensors.keys()))

    def check(self, pushed: dict[str, TensorInfo]) -> None:
        """Raises WeightError listing every missing, unexpected or mismatched tensor."""
        problems = []
        missing = sorted(self.tensors.keys() - pushed.keys())
        unexpected = sorted(pushed.keys() - self.tensors.keys() - self.ignorable)
        if missing:
            problems.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            problems.append(f"unknown tensors {', '.join(unexpected[:3])}")
        for name in sorted(self.tensors.keys() & pushed.keys()):
            want, got = self.tensors[name], pushed[name]
            if want.shape != got.shape:
                problems.append(f"{name}: shape {list(got.shape)}, expected {list(want.shape)}")
            if want.dtype != got.dtype and not self._engine_cast(want.dtype, got.dtype):
                expected = (
                    want.dtype
                    if not self._engine_cast(want.dtype, self.engine_dtype)
                    else (f"{want.dtype} or {self.engine_dtype}")
                )
                problems.append(f"{name}: dtype {got.dtype}, expected {expected}")
        if problems:
            raise WeightError("weights do not fit the model: " + "; ".join(problems[:8]))

    def _engine_cast(self, checkpoint: str, pushed: str | None) -> bool:
        """Whether a floating checkpoint tensor pushed in the engine's dtype is accepted."""
        return pushed is not None and pushed == self.engine_dtype and checkpoint in FLOATING_DTYPES


FLOATING_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


def checkpoint_state_dict(state_dict: dict[str, torch.Tensor]) -> dict:
    """CPU, contiguous tensors that safetensors can write; only tensors sharing storage are copied."""
    out, seen = {}, set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out


def to_payload(state_dict: dict[str, torch.Tensor]) -> bytes:
    """A state dict as safetensors bytes (what UpdateWeights streams)."""
    from safetensors.torch import save

    return save(checkpoint_state_dict(state_dict))


# torch dtype -> safetensors spelling, for the payloads written here.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# torch's dtype name ("bfloat16", as RolloutStatus.dtype says it) -> safetensors spelling.
SAFETENSORS_NAMES = {str(dtype).removeprefix("torch."): name for dtype, name in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class Payload:
    """A state dict laid out as a safetensors file, without copying it: the file's first bytes (length and
    JSON header), then each tensor's bytes in order. Written to a file or streamed from memory as it is."""

    head: bytes
    buffers: list[memoryview]  # one flat byte view per tensor, in data_offsets order

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(b.nbytes for b in self.buffers)

    def blocks(self, block_bytes: int) -> Iterator[memoryview]:
        """The payload's bytes in order, in non-empty slices of at most `block_bytes` (never across two tensors)."""
        for buffer in (memoryview(self.head), *self.buffers):
            for start in range(0, buffer.nbytes, block_bytes):
                yield buffer[start : start + block_bytes]

    def digest(self, algorithm: str = PAYLOAD_DIGEST) -> str:
        """The hex digest of the payload's bytes, as a file of them would hash."""
        hasher = new_hasher(algorithm)
        for block in self.blocks(HASH_BLOCK_BYTES):
            hasher.update(block)
        return hasher.hexdigest()


def payload_of(state_dict: dict[str, torch.Tensor]) -> Payload:
    """`state_dict` as a safetensors `Payload` over the tensors' own memory (see `checkpoint_state_dict`).

    safetensors' `save_file` would first allocate and fill a file: in shared memory that page allocation
    was most of its ~0.22 s at 104M fp32 parameters, which a streamed push need not pay on the sender.
    """
    tensors = checkpoint_state_dict(state_dict)
    header, buffers, offset = {}, [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise WeightError(f"{name}: dtype {tensor.dtype} has no safetensors spelling here")
        buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + buffer.nbytes],
        }
        buffers.append(buffer)
        offset += buffer.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header so the data starts 8-byte aligned
    return Payload(struct.pack("<Q", len(text)) + text, buffers)


def write_payload(state_dict: dict[str, torch.Tensor], path: Path, algorithm: str = PAYLOAD_DIGEST) -> str:
    """Writes a state dict as a safetensors file; returns its hex digest with `algorithm`.

    Hashed while written, each block while it is still in cache: one pass over the tensors, not a write
    then a read of the file (at 104M fp32 parameters: ~0.23 s for both, against ~0.22 s + 0.05 s).
    """
    payload = payload_of(state_dict)
    hasher = new_hasher(algorithm)
    with Path(path).open("wb") as f:
        for block in payload.blocks(HASH_BLOCK_BYTES):
            f.write(block)
            hasher.update(block)
    return hasher.hexdigest()
