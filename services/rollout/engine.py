"""One vLLM engine driven by one thread: generation batches and weight loads never overlap.

Requests are queued; the engine thread takes every queued generation request at once (up to
`max_batch_prompts` prompts), adds them to vLLM together and steps the engine until they are done,
so concurrent callers share vLLM's batch. A weight load is a queue item of its own: it runs between
two batches, which makes it atomic with respect to generation — every sample of a batch carries the
one version it was generated with.

Between two engine steps the thread aborts the vLLM requests of callers that gave up (cancelled, or
past their deadline), so abandoned work stops within a step. A request vLLM refuses fails alone; the
thread survives any per-request error. When the thread or vLLM's engine core dies anyway, `failure`
says so and `fail_waiting` releases every caller, for the worker's watchdog (services/rollout/main.py).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import connection
from pathlib import Path

from rlep.common.types import FinishReason
from rlep.services.rollout.broadcast_receiver import (
    BroadcastFailed,
    BroadcastReceipt,
    BroadcastReceiver,
    ModelCorrupted,
)
from rlep.services.rollout.config import EngineConfig
from rlep.services.rollout.load_logs import cast_summary
from rlep.services.rollout.types import Generation, SampleOut, Sampling, prompt_seed
from rlep.services.rollout.vllm_args import engine_kwargs, sampling_params, shutdown_llm, weight_reload_problem

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rlep.services.rollout.worker_extension.WeightSyncExtension"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
# close() waits this long for the engine thread (a running batch ends at its next engine step), then
# gives vLLM's engine core ENGINE_SHUTDOWN_S to exit before it is killed: vLLM's default, 5 s, was
# most of a worker's stop time, and a stopping worker has nothing left to save.
CLOSE_JOIN_S = 5.0
ENGINE_SHUTDOWN_S = 1.0


class EngineUnavailable(RuntimeError):
    """The engine cannot serve: it is shutting down, or its thread or engine core died."""


class CallAbandoned(RuntimeError):
    """The caller cancelled the call or its deadline passed; its vLLM requests were aborted."""


@dataclass(eq=False)
class _Job:
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _GenerateJob(_Job):
    """One caller's prompts; `cancel()` (any thread) makes the engine thread abort them at its next step."""

    prompts: Sequence[Sequence[int]] = ()
    params: object = None  # vllm.SamplingParams, built and checked in the caller's thread
    deadline: float | None = None  # time.monotonic()
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def gave_up(self) -> bool:
        return self.cancelled or (self.deadline is not None and time.monotonic() >= self.deadline)

    def result(self, timeout_s: float | None = None) -> Generation:
        """Waits for the samples; on TimeoutError the job is cancelled (its requests get aborted)."""
        try:
            return self.future.result(timeout=timeout_s)
        except TimeoutError:
            self.cancel()
            raise


@dataclass(eq=False)
class _LoadJob(_Job):
    path: Path = Path()
    version: int = 0
    behind_generation: bool = False  # queued while a batch was generating, so it had to wait for it


@dataclass(eq=False)
class _BroadcastJob(_Job):
    """Receive a state dict broadcast by the learner over NCCL or gloo (services/weights/broadcast.py)."""

    group: object = None  # BroadcastGroup
    rank_offset: int = 1
    entries: Sequence = ()  # (name, TensorInfo) in broadcast order
    version: int = 0
    bucket_bytes: int = 0


class VersionError(ValueError):
    """A weight push whose version is not newer than the engine's."""


class RolloutEngine:
    def __init__(self, config: EngineConfig, initial_version: int = 0, max_batch_prompts: int = 4096):
        from vllm import LLM

        if problem := weight_reload_problem():  # refuse to start, rather than fail at the first weight push
            raise RuntimeError(problem)
        kwargs = engine_kwargs(config)
        self.model_path = kwargs["model"]
        self._llm = LLM(**kwargs, worker_extension_cls=WORKER_EXTENSION)
        self.tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.llm_engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self.dtype = str(model_config.dtype).removeprefix("torch.")
        """The dtype the engine's weights are in (vLLM's `dtype: auto` downcasts a float32 checkpoint to bfloat16)."""
        self.workers: int = self._llm.llm_engine.vllm_config.parallel_config.world_size
        """vLLM workers (tensor x pipeline parallel): each is one rank of a weight broadcast (GetStatus `workers`)."""
        casts = cast_summary(self._weight_casts(), "start") or "none cast on load"
        log.info("rollout engine runs %s; weights: %s", self.dtype, casts)
        self._version = initial_version
        self._max_batch_prompts = max_batch_prompts
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: _Job | None = None
        self._open: weakref.WeakSet[_Job] = weakref.WeakSet()  # jobs someone may wait on (`fail_waiting`)
        self._request_ids = itertools.count()
        self._closing = False
        self._thread_error: str | None = None
        self._retired: str | None = None  # why the model can no longer be trusted (a broadcast failed mid-load)
        # Counters, for metrics and for tests that must see an event happen (`wait_until`).
        self._changed = threading.Condition()
        self.generated_tokens = 0
        self.aborted_requests = 0  # vLLM requests (one per sample) aborted because their caller gave up
        self.loads_behind_generation = 0  # weight loads that were queued while a batch was generating
        self.batch_running = False
        self._broadcasts = BroadcastReceiver(self._llm)
        self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer generate (its thread or its engine core died), or None."""
        if self._closing:
            return None  # stopping on purpose
        if self._retired:
            return self._retired
        if self._thread_error or not self._thread.is_alive():
            return f"the rollout engine thread stopped: {self._thread_error or 'no error recorded'}"
        return "the vLLM engine core process died" if self._core_dead() else None

    def _core_dead(self) -> bool:
        # vLLM's flag is set by its monitor thread, which can lag behind the socket errors step() sees first.
        resources = getattr(self._llm.llm_engine.engine_core, "resources", None)  # None when in-process
        if resources is None:
            return False
        processes = getattr(resources.engine_manager, "processes", [])
        return resources.engine_dead or bool(connection.wait([p.sentinel for p in processes], timeout=0))

    @property
    def running_requests(self) -> int:
        """vLLM requests (one per sample) not finished yet."""
        return self._llm.llm_engine.get_num_unfinished_requests()

    def wait_until(self, predicate: Callable[[RolloutEngine], bool], timeout_s: float) -> bool:
        """Blocks until `predicate(self)` holds (checked whenever a counter changes); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout=timeout_s)

    def _count(self, batch_running: bool | None = None, **increments: int) -> None:
        with self._changed:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)
            if batch_running is not None:
                self.batch_running = batch_running
            self._changed.notify_all()

    # -- public API (any thread) --------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling, timeout_s: float | None = None):
        """Queues token-id prompts; returns the job (`.result(timeout_s)`, `.cancel()`).

        ValueError, raised here in the caller's thread, when vLLM refuses the sampling options.
        """
        params = sampling_params(sampling)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return self._put(_GenerateJob(prompts=prompts, params=params, deadline=deadline))

    def load_weights(self, path: Path, version: int, timeout_s: float | None = None) -> float:
        """Loads a validated safetensors payload as `version`; returns the load time in seconds."""
        job = self._put(_LoadJob(path=path, version=version, behind_generation=self.batch_running))
        return job.future.result(timeout=timeout_s)

    def receive_broadcast(
        self, group, rank_offset: int, entries: Sequence, version: int, bucket_bytes: int
    ) -> BroadcastReceipt:
        """Joins `group` (unless its workers are members already) and receives `entries` as `version`, loading a
        bucket at a time. BroadcastFailed when it fails before loading began: the previous version keeps serving.
        EngineUnavailable when it fails later (the model is part old, part new) or a collective is stuck on the
        device: the engine is then retired for good (`failure`), and the worker's watchdog ends it."""
        job = _BroadcastJob(
            group=group, rank_offset=rank_offset, entries=entries, version=version, bucket_bytes=bucket_bytes
        )
        return self._put(job).future.result()

    def fail_waiting(self, reason: str) -> int:
        """Fails every queued or running job with EngineUnavailable (their callers return at once)."""
        with self._changed:
            jobs = list(self._open)
        return sum(_settle(job.future, error=EngineUnavailable(reason)) for job in jobs)

    def close(self) -> None:
        """Stops now: running requests are aborted, queued callers get EngineUnavailable."""
        broken = self.failure is not None
        self._closing = True
        self._queue.put(None)
        self.fail_waiting("the rollout worker is shutting down")
        if not broken:  # a thread stuck on a dead engine core would never return
            self._thread.join(timeout=CLOSE_JOIN_S)
        shutdown_llm(self._llm, ENGINE_SHUTDOWN_S)

    def _put(self, job: _Job) -> _Job:
        if self._closing or self.failure is not None:
            raise EngineUnavailable(self.failure or "the rollout worker is shutting down")
        with self._changed:
            self._open.add(job)
        self._queue.put(job)
        return job

    # -- engine thread -----------------------------------------------------------------------
    def _next_job(self) -> _Job | None:
        if self._pending is not None:
            job, self._pending = self._pending, None
        else:
            job = self._queue.get()
        # A retired model generates nothing more: queued callers are released by the watchdog (`fail_waiting`).
        return None if self._closing or self._retired else job

    def _run(self) -> None:
        try:
            while (job := self._next_job()) is not None:
                if isinstance(job, _LoadJob):
                    self._finish(job, self._load)
                elif isinstance(job, _BroadcastJob):
                    self._finish(job, self._receive_broadcast)
                else:
                    self._generate_batch(self._collect_batch(job))
        except BaseException as err:  # a bug: the watchdog sees the thread gone and retires the replica
            self._thread_error = repr(err)
            log.exception("the rollout engine thread died")
            raise
        log.info("rollout engine thread stopped")

    def _collect_batch(self, first: _GenerateJob) -> list[_GenerateJob]:
        batch, count = [first], len(first.prompts)
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
        return batch

    @staticmethod
    def _finish(job: _Job, work: Callable) -> None:
        try:
            _settle(job.future, value=work(job))
        except Exception as err:  # handed to the caller, who maps it to a status
            _settle(job.future, error=err)

    def _say_casts(self, what: str) -> None:
        """One line when a push had to be cast (the learner sends the engine's dtype; a checkpoint file may not)."""
        if line := cast_summary(self._weight_casts(), what):
            log.info("%s", line)

    def _weight_casts(self) -> dict[str, int]:
        """Dtype casts vLLM made loading weights since the last call (the first worker's; all load the same)."""
        return self._llm.collective_rpc("take_weight_casts")[0]

    def _check_newer(self, version: int) -> None:
        if version <= self._version:
            raise VersionError(f"version {version} is not newer than the current version {self._version}")

    def _load(self, job: _LoadJob) -> float:
        self._check_newer(job.version)
        started = time.perf_counter()
        self._llm.collective_rpc("load_safetensors_file", args=(str(job.path),))
        self._say_casts(f"push of version {job.version}")
        self._llm.reset_prefix_cache()
        self._version = job.version
        if job.behind_generation:
            self._count(loads_behind_generation=1)
        return time.perf_counter() - started

    def _receive_broadcast(self, job: _BroadcastJob) -> BroadcastReceipt:
        self._check_newer(job.version)
        started = time.perf_counter()
        versions = (self._version, job.version)
        try:
            outcomes = self._broadcasts.receive(job.group, job.rank_offset, job.entries, job.bucket_bytes, versions)
        except ModelCorrupted as err:
            self._retired = str(err)
            raise EngineUnavailable(self._retired) from err
        except BroadcastFailed:
            raise
        except Exception as err:
            if isinstance(error := self._engine_error(err), EngineUnavailable):
                raise error from err
            raise BroadcastFailed(f"the weight broadcast failed, version {self._version} still serves: {err}") from err
        self._say_casts(f"broadcast of version {job.version}")
        self._llm.reset_prefix_cache()
        self._version = job.version
        return BroadcastReceipt(time.perf_counter() - started, max(o["peak_bytes"] for o in outcomes))

    def _add_requests(self, job: _GenerateJob) -> list[str]:
        """Adds one job's prompts to vLLM; if vLLM refuses one, the job's others are taken back."""
        from vllm.inputs import TokensPrompt

        engine, ids, seed = self._llm.llm_engine, [], job.params.seed
        try:
            for index, prompt in enumerate(job.prompts):
                request_id = str(next(self._request_ids))
                params = job.params
                if seed is not None:  # each prompt its own random stream (prompt_seed says why)
                    params = job.params.clone()
                    params.seed = prompt_seed(seed, index)
                engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)
                ids.append(request_id)
        except Exception:
            if ids:
                engine.abort_request(ids)
            raise
        return ids

    def _generate_batch(self, batch: list[_GenerateJob]) -> None:
        engine = self._llm.llm_engine
        started = time.perf_counter()
        live: list[tuple[_GenerateJob, list[str]]] = []
        for job in batch:
            if job.future.done() or job.gave_up():
                _settle(job.future, error=CallAbandoned("the caller gave up before generation started"))
                continue
            try:
                live.append((job, self._add_requests(job)))
            except Exception as err:  # vLLM refused this job's input: only this caller hears of it
                _settle(job.future, error=self._engine_error(err))
        self._count(batch_running=True)
        try:
            outputs = {}
            while True:
                live = self._abort_abandoned(live)
                if not engine.has_unfinished_requests():  # else step() waits for output that never comes
                    break
                outputs.update((out.request_id, out) for out in engine.step() if out.finished)
            self._deliver(live, outputs, started)
        except Exception as err:  # the batch's callers get the error; the thread goes on with the next batch
            log.exception("generation failed for a batch of %d calls", len(live))
            error = self._engine_error(err)
            for job, ids in live:
                if not isinstance(error, EngineUnavailable):
                    engine.abort_request(ids)
                _settle(job.future, error=error)
        finally:
            self._count(batch_running=False)

    def _engine_error(self, err: Exception) -> Exception:
        """EngineUnavailable when `err` comes from a dead or closing engine (a killed engine core surfaces
        as EngineDeadError or as a socket error of its client), else `err` itself."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(err, EngineDeadError) or self._closing or self.failure is not None:
            return EngineUnavailable(f"the vLLM engine stopped: {err}")
        return err

    def _abort_abandoned(self, live: list[tuple[_GenerateJob, list[str]]]) -> list[tuple[_GenerateJob, list[str]]]:
        """Aborts the requests of callers that gave up (or of everyone when closing); returns the rest."""
        kept = []
        for job, ids in live:
            if self._closing or job.future.done() or job.gave_up():
                unfinished = self.running_requests
                self._llm.llm_engine.abort_request(ids)
                _settle(job.future, error=CallAbandoned("the caller gave up; its requests were aborted"))
                self._count(aborted_requests=unfinished - self.running_requests)
            else:
                kept.append((job, ids))
        return kept

    def _deliver(self, live, outputs: dict, started: float) -> None:
        elapsed = time.perf_counter() - started
        tokens_total = 0
        for job, ids in live:
            if job.future.done():
                continue
            mine = [outputs[i] for i in ids]
            samples = [[self._sample(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in mine]
            tokens = sum(len(s.token_ids) for group in samples for s in group)
            tokens_total += tokens
            _settle(job.future, value=Generation(samples, self._version, started - job.enqueued, elapsed, tokens))
        self._count(generated_tokens=tokens_total)

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


def _settle(future: Future, value=None, error: BaseException | None = None) -> bool:
    """Completes `future` unless it is done already (a job may be failed by `fail_waiting` meanwhile)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except Exception:  # InvalidStateError: settled first by another thread
        return False
    return True
