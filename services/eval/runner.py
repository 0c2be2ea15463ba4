"""Runs evaluation jobs: claims them from the store, samples through rollout, scores through the verifier.

One worker thread per service process runs one job at a time (a checkpoint job owns eval's rollout
deployment while it runs, so jobs must not interleave there). A keeper thread renews the running job's
lease and fails jobs whose service died (expired lease). A job advances a chunk of
`questions_per_call` questions at a time: generate, verify, score, save progress and the chunk's samples
(eval/samples.py). Cancellation and
shutdown take effect at the next chunk boundary (the Generate call in flight runs to its end, but its
responses are not verified); on shutdown the running job goes back to the head of the queue and starts
over when a service (this one restarted, or another replica) is up.
"""

from __future__ import annotations

import logging
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from rlep.common.dataset import Question
from rlep.common.files import load_safetensors
from rlep.common.types import FinishReason
from rlep.services.eval import tracking
from rlep.services.eval.accuracy import DatasetTally, SampleScore, score_question
from rlep.services.eval.api import DatasetResult, EvaluationJob, JobStatus
from rlep.services.eval.config import EvalConfig
from rlep.services.eval.inputs import CURRENT_POLICY, checkpoint_files, load_dataset
from rlep.services.eval.samples import QuestionSamples, first_samples, sample_records
from rlep.services.eval.store import JobStore, new_attempt
from rlep.services.rollout.client import RolloutClient, RolloutError
from rlep.services.rollout.types import Completion, Sampling
from rlep.services.verifier.client import VerifierClient, verify_groups

log = logging.getLogger(__name__)

# How long an idle worker waits before looking at the queue again (a local submission wakes it at once;
# jobs submitted to another replica are found within this delay).
IDLE_POLL_S = 1.0
# Characters of a library's reason quoted in a job's error (a rollout error lists every replica's failure).
REASON_CHARS = 300


class JobAbandoned(Exception):
    """The job is no longer this worker's: cancelled, requeued on shutdown, or declared dead."""


def describe_error(err: BaseException) -> str:
    """A one-line reason for a failed job; gRPC errors give their status and the server's message."""
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"


def load_checkpoint(model: str, allowed_roots: list[Path] | None) -> dict:
    """A checkpoint's full state dict from its safetensors files (never unpickled)."""
    return load_safetensors(checkpoint_files(model, allowed_roots))


@dataclass
class Backends:
    """The services a job drives; `checkpoint_rollout` is None when checkpoints are not accepted."""

    rollout: RolloutClient
    checkpoint_rollout: RolloutClient | None
    verifier: VerifierClient


class OutageLog:
    """Logs a call that keeps failing once, with its traceback, and once more when it works again: a Redis outage
    of a minute is two lines, not a traceback a second (which also filled an unread pipe and froze the process)."""

    def __init__(self, what: str):
        self.what, self.failures = what, 0

    def failed(self, err: Exception) -> None:
        self.failures += 1
        if self.failures == 1:
            log.error("%s (retrying; said again when it works): %s", self.what, err, exc_info=err)

    def worked(self) -> None:
        if self.failures:
            log.warning("%s: works again after %d failed tries", self.what, self.failures)
            self.failures = 0


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        backends: Backends,
        config: EvalConfig,
        on_questions: Callable[[int], None] = lambda count: None,
        on_job_end: Callable[[JobStatus, float], None] = lambda status, seconds: None,
    ):
        self._store, self._backends, self._config = store, backends, config
        self._on_questions, self._on_job_end = on_questions, on_job_end
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._current: tuple[str, str] | None = None  # (job id, attempt) being run
        self._claim_failures, self._keeper_failures = OutageLog("cannot claim eval jobs"), OutageLog("eval keeper")
        self._dead_reason = (
            f"the eval service running this job stopped without finishing it (no heartbeat for "
            f"{config.lease_s:g} s); submit it again to rerun it"
        )
        self._threads = [
            threading.Thread(target=self._work, name="eval-worker", daemon=True),
            threading.Thread(target=self._keep, name="eval-keeper", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def wake(self) -> None:
        """A job was queued here: look at the queue now instead of at the next poll."""
        self._wake.set()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops taking jobs; the running one (if any) is requeued to start over after a restart."""
        self._stopping.set()
        self._wake.set()
        current = self._current
        if current is not None and self._store.requeue(*current):
            log.info("eval job %s requeued: the service is stopping", current[0])
        for thread in self._threads:
            thread.join(grace_s)

    # -- threads -------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                attempt = new_attempt()
                job_id = self._store.claim(attempt, self._config.lease_s)
            except Exception as err:  # Redis unreachable: keep the thread alive and retry
                self._claim_failures.failed(err)
                job_id = None
            else:
                self._claim_failures.worked()
            if job_id is None:
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()
                continue
            self._current = (job_id, attempt)
            try:
                if self._stopping.is_set():  # claimed while stop() was looking: hand it back as stop() would
                    self._store.requeue(job_id, attempt)
                    return
                self._run(job_id, attempt)
            finally:
                self._current = None

    def _keep(self) -> None:
        next_reap = 0.0
        while not self._stopping.wait(self._config.lease_s / 4):
            try:
                current = self._current
                if current is not None:
                    self._store.renew_lease(*current, self._config.lease_s)
                if time.monotonic() >= next_reap:
                    self.reap_dead_jobs()
                    next_reap = time.monotonic() + self._config.lease_s
            except Exception as err:  # Redis unreachable: the next round tries again
                self._keeper_failures.failed(err)
            else:
                self._keeper_failures.worked()

    def reap_dead_jobs(self) -> list[str]:
        """Marks failed, with the reason, every running job whose service stopped renewing its lease."""
        dead = self._store.reap_expired(self._dead_reason)
        for job_id in dead:
            log.warning("eval job %s marked failed: its service died", job_id)
        return dead

    # -- one job -------------------------------------------------------------------------------
    def _run(self, job_id: str, attempt: str) -> None:
        started = time.monotonic()
        job = self._store.get(job_id)
        if job is None:
            return
        log.info("eval job %s started: model=%s", job_id, job.request.model)
        try:
            self._execute(job, attempt)
            status, error = JobStatus.SUCCEEDED, None
        except JobAbandoned:
            log.info("eval job %s stopped: it was cancelled or requeued", job_id)
            after = self._store.get(job_id)
            if after is not None and after.status == JobStatus.CANCELLED:
                self._on_job_end(JobStatus.CANCELLED, time.monotonic() - started)
            return
        except Exception as err:
            log.exception("eval job %s failed", job_id)
            status, error = JobStatus.FAILED, describe_error(err)
        try:
            if self._store.finish(job_id, attempt, status, error):
                self._on_job_end(status, time.monotonic() - started)
        except Exception:  # the lease expires and the reaper records the failure instead
            log.exception("cannot record the end of eval job %s", job_id)

    def _execute(self, job: EvaluationJob, attempt: str) -> None:
        request = job.request
        rollout, pushed_version = self._prepare_model(request.model)
        sampling = Sampling(
            n=request.n,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_tokens,
            seed=request.seed,
        )
        progress = job.progress.model_copy(update={"questions_done": 0, "samples_done": 0})
        results: list[DatasetResult] = []
        versions: set[int] = set() if pushed_version is None else {pushed_version}
        kept = 0  # samples stored by this attempt (its claim emptied the job's list): the first max_stored_samples
        # The job runs at most the questions checked at submission, even if a user file has grown since.
        budget = job.progress.questions_total
        for spec in request.datasets:
            if budget <= 0:
                break
            questions = load_dataset(spec.name, min(spec.limit or budget, budget), self._config.allowed_roots)
            budget -= len(questions)
            tally = DatasetTally()
            results.append(_result(spec.name, len(questions), tally))
            progress.current_dataset = spec.name
            for start in range(0, len(questions), self._config.questions_per_call):
                if self._stopping.is_set():
                    raise JobAbandoned()
                chunk = questions[start : start + self._config.questions_per_call]
                try:
                    completions = rollout.generate([q.chat() for q in chunk], sampling)
                except RolloutError as err:
                    raise RolloutError(self._no_replica(request.model, str(err))) from err
                # A job cancelled while its chunk was generating must not cost verifier time as well.
                if not self._store.renew_lease(job.id, attempt, self._config.lease_s):
                    raise JobAbandoned()
                seen, records = self._score_chunk(spec.name, start, chunk, completions, tally)
                stored = first_samples(records, self._config.max_stored_samples - kept)
                scored, count = (sum(len(record.rows) for record in part) for part in (records, stored))
                kept += count
                if pushed_version is not None and seen != {pushed_version}:
                    raise RuntimeError(
                        f"samples came from policy versions {sorted(seen)}, not the pushed checkpoint "
                        f"({pushed_version}): another client pushed weights to eval's rollout deployment"
                    )
                versions |= seen
                progress.questions_done += len(chunk)
                progress.samples_done += len(chunk) * request.n
                results[-1] = _result(spec.name, len(questions), tally)
                saved = self._store.save_progress(
                    job.id, attempt, progress, results, sorted(versions), stored, scored - count
                )
                if not saved:
                    raise JobAbandoned()
                self._on_questions(len(chunk))
        progress.current_dataset = None
        if not self._store.save_progress(job.id, attempt, progress, results, sorted(versions)):
            raise JobAbandoned()
        if self._config.tensorboard_dir is not None:
            tracking.write_job(
                self._config.tensorboard_dir / job.id, request.model, results, request.n, max(versions, default=0)
            )

    def _prepare_model(self, model: str) -> tuple[RolloutClient, int | None]:
        """Where to sample from, and the version pushed for a checkpoint (None: the current policy)."""
        if model == CURRENT_POLICY:
            follow_replicas(self._backends.rollout, newest_only=True)
            return self._backends.rollout, None
        target = self._backends.checkpoint_rollout
        if target is None:
            raise RuntimeError("this eval service has no checkpoint_rollout deployment configured")
        follow_replicas(target)
        state_dict = load_checkpoint(model, self._config.allowed_roots)
        versions = target.versions()
        if not versions:
            raise RolloutError(self._no_replica(model, "no replica answered GetStatus"))
        version = max(versions) + 1
        target.push_weights(state_dict, version)
        log.info("checkpoint %s pushed to eval's rollout deployment as version %d", model, version)
        return target, version

    def _no_replica(self, model: str, reason: str) -> str:
        """A failed job's error when no replica of the deployment `model` samples from answers: which deployment,
        where it was looked for, and how to start it or point the service at it; `reason` is cut short."""
        current = model == CURRENT_POLICY
        field = "rollout" if current else "checkpoint_rollout"
        endpoints = self._config.rollout if current else self._config.checkpoint_rollout
        where = ", ".join(endpoints.names()) if endpoints else "-"
        key = "service" if endpoints and endpoints.service else "addresses"
        what = "the policy being trained" if current else "eval's own rollout deployment"
        start = "`rlep train` or `rlep serve rollout`" if current else "`rlep serve rollout`"
        return (
            f"no replica of {what} ({field}: {where}) served model {model!r}; start it ({start}) if it is not "
            f"running, or point the eval service's {field}.{key} at it ({textwrap.shorten(reason, REASON_CHARS)})"
        )

    def _score_chunk(
        self, dataset: str, first: int, chunk: list[Question], completions: list[Completion], tally: DatasetTally
    ) -> tuple[set[int], list[QuestionSamples]]:
        """Verifies and scores one chunk of questions (the first is question `first` of `dataset`) into `tally`;
        returns the policy versions seen and the samples' records."""
        groups = [(q.ground_truth, [s.text for s in c.samples]) for q, c in zip(chunk, completions, strict=True)]
        versions: set[int] = set()
        records: list[QuestionSamples] = []
        verified = verify_groups(self._backends.verifier, groups, [q.data_source for q in chunk])
        for index, (question, completion, outcomes) in enumerate(zip(chunk, completions, verified, strict=True)):
            scores = []
            for sample, outcome in zip(completion.samples, outcomes, strict=True):
                truncated = sample.finish_reason == FinishReason.LENGTH
                scores.append(SampleScore(outcome.verdict, outcome.extracted_answer, len(sample.token_ids), truncated))
                versions.add(sample.policy_version)
            tally.add(score_question(scores))
            records.append(sample_records(dataset, first + index, question, completion.samples, outcomes))
        return versions, records


def follow_replicas(rollout: RolloutClient, newest_only: bool = False) -> None:
    """Re-reads `rollout`'s replica set (DNS / Ray registry) and serves with the replicas that answer. With
    `newest_only` (the learner's deployment, which eval never pushes to), only those on the newest policy version:
    a replica that came back at its initial weights waits for the learner to update it. A fixed address list is
    left as it is: its calls fail over between the replicas, and a status check would only add a round trip."""
    if not rollout.follows_a_source:
        return
    rollout.refresh()
    answering = [(replica, status) for replica, status in rollout.check() if status is not None]
    if newest_only and answering:
        newest = max(status.policy_version for _, status in answering)
        answering = [(replica, status) for replica, status in answering if status.policy_version == newest]
    rollout.set_serving([replica for replica, _ in answering])


def _result(name: str, questions_total: int, tally: DatasetTally) -> DatasetResult:
    return DatasetResult(dataset=name, questions_total=questions_total, **tally.summary())
