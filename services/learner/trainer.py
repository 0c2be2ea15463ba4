"""One RLEP training run: the step loop over the services, checkpoints and resume.

A step (RLEP / DAPO-nodyn, defaults in config.py): B questions from the cursor, rendered and
left-truncated by the learner (`tokens.py`) -> rollout samples G each -> verifier scores them
(+ overlong shaping); with dynamic sampling, groups whose rewards are all equal are dropped and more
questions generated until B are kept -> replay adds M stored successes per question, laid out and
scored like fresh samples (`scored_trajectories.py`) -> advantages over each mixed group of G+M -> old logprobs
of all G+M under the current weights -> PPO mini-batch updates with DAPO's loss -> new weights pushed
to every rollout replica. M=0 is the baseline, on the same path.

With `algorithm.max_staleness` = k >= 1, generation and scoring of the next k steps run on a background
thread while this step trains (overlap.py); the bound is checked per sample and recorded.

Weights reach the replicas from the learner process that holds them: for the payload transports the policy's
rank 0 writes and sends them itself (`Policy.push_weights`), so they never cross Ray's object store or this
process; for NCCL this process starts the calls and rank 0 broadcasts.

The policy object (the `Policy` Protocol of policy_interface.py) does the tensor work (a local
`DeepSpeedPolicy`, or `RayPolicy` spreading it over DeepSpeed processes); everything else here is bookkeeping
and service calls. Each step returns a `StepRecord` (records.py), which is also logged and sent to the gauges
and to TensorBoard / W&B (tracking.py).

Numbering: a step's record says `step` = the training steps completed, that one included (the first step is
step 1), and every log line about a step names that number. `self.step` counts the steps completed, so the step
being trained is `self.step + 1`; the 0-based index (`self.step` during the step) only seeds its sampling.
Policy versions grow by one per push and never go back, across `--resume` too: a resumed run starts above the
checkpoint's version, the step log's last version and whatever the replicas serve.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import numpy as np
import torch

from rlep.common.policy_info import write_policy_info
from rlep.common.types import Group, Trajectory, Verdict
from rlep.services.learner import generation_log
from rlep.services.learner.algorithm import KlEstimator, flatten_groups, kl_estimate
from rlep.services.learner.batch import ExperienceBatch, build_batch, with_kl_reward_penalty
from rlep.services.learner.checkpoint_info import latest_checkpoint, shape_problem, write_checkpoint_info
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.cursor import DataCursor, Question
from rlep.services.learner.metrics import LearnerMetrics
from rlep.services.learner.mismatch import correction_figures, rollout_mismatch
from rlep.services.learner.overlap import GatherAhead, Staleness, drop_stale_groups, fresh_staleness
from rlep.services.learner.policy_interface import Policy
from rlep.services.learner.records import EvalRecord, LogRecord, StepRecord, format_record
from rlep.services.learner.replay_priorities import policy_surprise, priority_updates
from rlep.services.learner.replay_signal import replay_signal
from rlep.services.learner.scored_trajectories import ReplayReport
from rlep.services.learner.step_inputs import Gathered, ServiceClients, StepInputs, StepTimer, verify_episodes
from rlep.services.learner.tokens import PolicyTokenizer
from rlep.services.learner.tool_rollouts import run_episodes
from rlep.services.learner.tracking import StepSink, run_dir
from rlep.services.rollout.client import Replica
from rlep.services.rollout.types import Sampling
from rlep.services.verifier.client import verify_groups
from rlep.services.weights.config import AutoSyncConfig, NcclSyncConfig
from rlep.services.weights.transport import setup_weight_transport

__all__ = ["Policy", "Trainer"]

GENERATIONS_FILE = "generations.jsonl"  # in the run's directory, beside the step log when that is there too
log = logging.getLogger(__name__)

SCORER_FAILURES_WARN = 0.1  # a step with more unscored fresh samples than this says so: rewards are not the task's


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        model_dir: Path,
        questions: list[Question],
        policy: Policy,
        services: ServiceClients,
        tokenizer: PolicyTokenizer,
        metrics: LearnerMetrics | None = None,
        eval_questions: list[Question] | None = None,
        on_step: Callable[[LogRecord], None] | None = None,
        sinks: Sequence[StepSink] = (),
    ):
        self.config, self.model_dir, self.questions, self.policy = config, model_dir, questions, policy
        self.services, self.tokenizer, self.metrics = services, tokenizer, metrics
        self.eval_questions = eval_questions or []
        self.on_step = on_step
        self.sinks = sinks  # TensorBoard / W&B (tracking.py); the caller closes them
        self.cursor = DataCursor(len(questions), config.seed, config.data.shuffle)
        self.step = 0
        self.version = 0
        algo = config.algorithm
        if (algo.replayed_per_question > 0 or algo.online_replay) and services.replay is None:
            raise ValueError("M > 0 or online replay needs a replay service")
        # The NCCL transport keeps its groups and the manifest across pushes: one instance for the run.
        self._broadcast = None
        if isinstance(config.weight_sync, NcclSyncConfig):
            # Each replica gets the ranks of the workers it reports; this run's engine config counts only for one
            # that does not say (an older server).
            tensor_parallel = config.local.rollout_engine.tensor_parallel_size
            reported = services.rollout.reported_workers
            self._broadcast = setup_weight_transport(config.weight_sync, policy, tensor_parallel, reported)
        self.inputs = StepInputs(config, questions, self.cursor, services, tokenizer)
        self._ahead = GatherAhead(self.inputs, algo.max_staleness, config.steps) if algo.max_staleness else None
        if algo.max_staleness:
            log.log(
                logging.INFO if algo.correction == "truncated_is" else logging.WARNING,
                "overlapped steps: samples up to %d version(s) stale, behavior correction %s%s",
                algo.max_staleness,
                algo.correction,
                "" if algo.correction == "truncated_is" else " (uncorrected staleness cost 0.08 accuracy on the demo)",
            )
        self._trained_cursor: dict[str, int] | None = None  # the cursor after the last trained step's draws
        # The name this run reports to the replay service's per-question history under: the run id and a nonce, kept
        # in checkpoints, so a resumed run's steps reported before the crash are not counted twice, and another run
        # with the same run_id on the same pool is not taken for a retry of this one.
        self.history_run = f"{re.sub(r'[^A-Za-z0-9_.:/-]', '_', config.run_id)[:119]}:{uuid.uuid4().hex[:8]}"
        # The step's history report is sent while its weights are pushed (`train_step`).
        self._reporting = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="history-report")
        self.log_path = config.log_file or (config.checkpoint.dir / "log.jsonl" if config.checkpoint.dir else None)

    # -- start, resume, weights --------------------------------------------------------------
    def start(self, resume: bool = False) -> None:
        """Restores the latest checkpoint when asked, then makes every rollout replica serve our weights."""
        ckpt, restored = self.config.checkpoint.dir, 0
        if resume:
            if ckpt is None or not (ckpt / "latest").exists():
                raise FileNotFoundError(f"--resume: no checkpoint under {ckpt}")
            # `rlep train` checks this before anything starts; a resume through the Python API reaches it here, before
            # DeepSpeed reads the files (under ZeRO-3 it fails on another shape's with a bare AssertionError).
            if (latest := latest_checkpoint(ckpt)) is not None and (problem := shape_problem(latest, self.config)):
                raise ValueError(problem)
            state = self.policy.load_checkpoint(ckpt)
            self.step = int(state["step"])
            self.cursor.restore(state["cursor"])
            self.history_run = state.get("history_run", self.history_run)  # checkpoints from before it: a new one
            random.setstate(_tuple_state(state["python_rng"]))
            np.random.set_state(_tuple_state(state["numpy_rng"]))
            torch.set_rng_state(state["torch_rng"])
            # The step log also knows steps that ran after this checkpoint and were lost, and the versions of
            # checkpoints written before the version was saved in them.
            restored = max(int(state.get("policy_version", 0)), _last_logged_version(self.log_path))
            log.info(
                "resumed after step %d (cursor %s, policy version %d so far); the next step is step %d",
                self.step,
                state["cursor"],
                restored,
                self.step + 1,
            )
        # Versions only grow: start above the checkpoint's (replicas started since serve a lower one) and above
        # whatever the replicas serve now (they may have outlived the run that pushed it).
        self.version = max(restored, max(self.services.rollout.versions())) + 1
        self.tokenizer.fit_model_length(self.services.rollout.max_model_len())
        log.info("prompts are left-truncated to %d tokens", self.tokenizer.max_prompt_tokens)
        self.push_weights()
        if self.step == 0 and self.eval_questions and self.config.eval.every_steps:
            # Where the run starts from: step 0 of the accuracy curve.
            accuracy, correct = self.evaluate()
            self._publish(EvalRecord(step=0, policy_version=self.version, eval_accuracy=accuracy, eval_correct=correct))

    def sync_rollout(self) -> None:
        """Brings replicas that (re)joined since the last push to our version before they serve again."""
        rollout = self.services.rollout
        rollout.refresh()
        checked = [(replica, status) for replica, status in rollout.check() if status is not None]
        rollout.set_serving([replica for replica, _ in checked])  # a failed push below takes one out again
        stale = [replica for replica, status in checked if status.policy_version != self.version]
        if stale:
            log.warning("bringing %d rollout replica(s) to version %d", len(stale), self.version)
            self.push_weights(replicas=stale)

    def push_weights(self, replicas: list[Replica] | None = None) -> None:
        """The policy's weights as `self.version` to every serving replica by the configured transport, or to
        `replicas` (ones that rejoined) by auto."""
        rollout = self.services.rollout
        if replicas is None and self._broadcast is not None:
            # The state dict is passed unread: the NCCL transport never gathers it here.
            rollout.push_weights(self.policy.state_dict, self.version, transport=self._broadcast)
            return
        sync = self.config.weight_sync if replicas is None else AutoSyncConfig()
        rollout.take_push_result(self.policy.push_weights(rollout.target(replicas), self.version, sync))

    def close(self) -> None:
        """Stops generating ahead (a gather already running finishes first)."""
        if self._ahead is not None:
            self._ahead.close()
        self._reporting.shutdown()

    # -- one step ----------------------------------------------------------------------------
    def train_step(self) -> StepRecord:
        algo, timer = self.config.algorithm, StepTimer()
        started = time.perf_counter()
        with timer.phase("rollout"):
            self.sync_rollout()
        gathered, staleness, stale_groups = self._gather(timer)
        replay = ReplayReport()
        replayed = self.inputs.replayed(self.step, gathered, replay, timer, policy_version=self.version)
        groups = [
            Group(q.question_id, q.ground_truth, fresh + replayed.get(q.question_id, []))
            for q, fresh in zip(gathered.questions, gathered.fresh, strict=True)
        ]
        # The sampler's logprobs ride along always: the mismatch is measured whether or not it is corrected.
        batch = build_batch(groups, self.tokenizer.pad_id, with_behavior=True)
        with timer.phase("train"):
            if algo.logprobs_mode == "processed_logprobs":  # the replicas' logprobs are of the tempered distribution
                old, processed = self.policy.logprobs_with_processed(batch, algo.temperature, algo.top_p)
                batch = batch.with_old_logprobs(old).with_old_processed_logprobs(processed)
            else:
                batch = batch.with_old_logprobs(self.policy.logprobs(batch))
            if algo.kl_coef > 0:  # a KL term to the starting checkpoint (not in the paper's recipe)
                batch = batch.with_ref_logprobs(self.policy.reference_logprobs(batch))
                if algo.kl_in == "reward":
                    batch = with_kl_reward_penalty(batch, algo.kl_coef, algo.kl_estimator)
            old = batch.old_processed_logprobs if batch.old_processed_logprobs is not None else batch.old_logprobs
            measured = (old, batch.behavior_logprobs, batch.loss_mask, algo.behavior_weight_cap)
            mismatch = rollout_mismatch(*measured)
            figures = {f"rollout_mismatch_{k}": v for k, v in mismatch.figures().items()} if mismatch else {}
            if algo.correction != "none":
                corrected = correction_figures(algo.correction, *measured)
                figures |= {f"rollout_correction_{k}": v for k, v in corrected.items()}
            if signal := replay_signal(
                batch.advantages, batch.rewards, batch.replayed, batch.group_index, batch.old_logprobs, batch.loss_mask
            ):
                figures |= {f"replay_{k}": v for k, v in signal.figures().items()}
            priorities = []
            if algo.replay_priority == "policy_surprise" and signal is not None:
                surprise = policy_surprise(batch.old_logprobs, batch.loss_mask, algo.replay_priority_floor)
                priorities = priority_updates(flatten_groups(groups)[0], batch.replayed, surprise)
            # By default mini-batches count fresh sequences (verl's ppo_mini_batch_size x n): replayed rows add updates.
            stats = self.policy.update(batch, algo.mini_batch_size)
        with timer.phase("weight_push"):
            self.version += 1
            # A report is idempotent and needs nothing of the push: sent meanwhile, it adds no time to the step.
            args = (self.history_run, self.step + 1, gathered, replayed, replay)
            reported = self._reporting.submit(self.inputs.report_outcomes, *args)
            prioritized = None
            if algo.replay_priority == "policy_surprise":
                prioritized = self._reporting.submit(self.inputs.update_priorities, priorities, replay)
            self.push_weights()
            reported.result()
            if prioritized is not None:
                prioritized.result()
        if algo.online_replay:
            self._add_successes(gathered.fresh)
        self.step += 1
        self._trained_cursor = gathered.cursor_state
        seconds = time.perf_counter() - started  # the evaluation below is not part of the step's time
        eval_accuracy, eval_correct = None, None
        if self.eval_questions and self.config.eval.every_steps and self.step % self.config.eval.every_steps == 0:
            eval_accuracy, eval_correct = self.evaluate()
        record = self._record(gathered, replay, batch, stats, timer, seconds, eval_accuracy, staleness, stale_groups)
        record = dataclasses.replace(record, **figures, eval_correct=eval_correct)
        self._publish(record)
        self._log_generations(gathered, groups)
        ckpt = self.config.checkpoint
        if ckpt.dir and (self.step % ckpt.every_steps == 0 or self.step == self.config.steps):
            self.save_checkpoint()
        return record

    def _gather(self, timer: StepTimer) -> tuple[Gathered, Staleness, int]:
        """This step's fresh groups, generated now (synchronous) or ahead (max_staleness > 0), with their
        staleness under the weights about to train; groups staler than the bound are left out."""
        if self._ahead is None:
            gathered = self.inputs.gather(self.step, timer)
            return gathered, fresh_staleness(gathered.fresh, self.version), 0
        bound = self.config.algorithm.max_staleness
        gathered, generation = self._ahead.take(self.step, timer)
        for phase in ("rollout", "verify"):
            timer.seconds[phase] += generation.seconds[phase]  # ran on the background thread, overlapping
        dropped = drop_stale_groups(gathered, self.version, bound)
        if dropped:
            log.warning(
                "step %d: %d fresh group(s) were staler than max_staleness=%d and are left out%s",
                self.step + 1,
                dropped,
                bound,
                "" if gathered.fresh else "; none was left, so this step generates again on current weights",
            )
        if not gathered.fresh:
            self._ahead.discard()
            with timer.phase("rollout"):
                self.sync_rollout()
            gathered = self.inputs.gather(self.step, timer)
            dropped += drop_stale_groups(gathered, self.version, bound)
            if not gathered.fresh:
                raise RuntimeError(
                    f"step {self.step + 1}: every fresh sample is staler than max_staleness={bound} even when "
                    f"generated after the replicas were brought to version {self.version}: a replica is not "
                    "taking weight pushes"
                )
        return gathered, fresh_staleness(gathered.fresh, self.version), dropped

    def _add_successes(self, fresh: list[list[Trajectory]]) -> None:
        # A void tool episode left out of the loss is left out of the pool too: replay would train on it.
        successes = [t for group in fresh for t in group if t.verdict == Verdict.CORRECT and not t.excluded_from_loss]
        if successes:
            self.services.replay.add(self.config.replay_pool, successes)

    # -- evaluation, logging, checkpoints ----------------------------------------------------
    def evaluate(self) -> tuple[float, list[int]]:
        """Accuracy of the served policy (this step's weights) on the held-out questions, and its correct samples per
        question (in the evaluation set's order)."""
        cfg = self.config.eval
        questions = self.eval_questions[: cfg.max_questions]
        prompts = [self.tokenizer.encode_prompt(q.chat()).token_ids for q in questions]
        sampling = Sampling(
            n=cfg.samples_per_question,
            temperature=cfg.temperature,
            max_tokens=self.config.algorithm.max_response_tokens,
            seed=self.config.seed,
        )
        if self.config.tools is not None:  # the policy is evaluated as it trains: with the tool, on its own tokens
            hf, generate = self.tokenizer.tokenizer, self.services.rollout.generate
            episodes = run_episodes(prompts, sampling, generate, self.services.run_code, hf, self.config.tools.loop)
            verified = verify_episodes(self.services.verifier, questions, episodes, hf)[1]
        else:
            completions = self.services.rollout.generate(prompts, sampling)
            groups = [
                (q.ground_truth, [s.text for s in c.samples]) for q, c in zip(questions, completions, strict=True)
            ]
            verified = verify_groups(self.services.verifier, groups, [q.data_source for q in questions])
        correct = [sum(o.verdict == Verdict.CORRECT for o in group) for group in verified]
        return sum(correct) / max(1, sum(len(group) for group in verified)), correct

    def _record(
        self,
        gathered: Gathered,
        replay: ReplayReport,
        batch: ExperienceBatch,
        stats: dict[str, float],
        timer: StepTimer,
        seconds: float,
        eval_accuracy: float | None,
        staleness: Staleness,
        stale_groups: int,
    ) -> StepRecord:
        flat = [t for group in gathered.fresh for t in group]
        failures = float(np.mean([t.verdict in (Verdict.ERROR, Verdict.TIMEOUT) for t in flat]))
        if failures > SCORER_FAILURES_WARN:
            log.warning(
                "step %d: the verifier could not score %.0f%% of the fresh samples (verdict ERROR or TIMEOUT, reward "
                "error_reward): its log names the scorer and why",
                self.step, 100 * failures,
            )  # fmt: skip
        return StepRecord(
            step=self.step,
            policy_version=self.version,
            reward_mean=float(np.mean([t.reward for t in flat])),
            fresh_accuracy=float(np.mean([t.verdict == Verdict.CORRECT for t in flat])),
            replayed_fraction=float(batch.replayed.float().mean()),
            **replay.record(),
            advantage_mean=float(batch.advantages.mean()),
            advantage_std=float(batch.advantages.std()) if batch.size > 1 else 0.0,
            clip_fraction=stats["clip_fraction"],
            approx_kl=stats["approx_kl"],
            kl_ref=stats.get("kl_ref", _kl_of(batch, self.config.algorithm.kl_estimator)),
            entropy=stats["entropy"],
            loss=stats["loss"],
            lr=stats["lr"],
            optimizer_steps=stats.get("optimizer_steps"),
            response_length_mean=float(np.mean([len(t.response_token_ids) for t in flat])),
            sequences=batch.size,
            prompts_truncated=gathered.prompts_truncated,
            generation_rounds=gathered.rounds,
            questions_generated=gathered.questions_generated,
            groups_filtered=gathered.groups_filtered,
            step_seconds=seconds,
            phase_seconds=dict(timer.seconds),
            question_ids=[q.question_id for q in gathered.questions],
            policy_staleness_max=staleness.max,
            policy_staleness_mean=staleness.mean,
            groups_dropped_stale=stale_groups,
            rollout_replicas=len(self.services.rollout.serving()),
            rollout_failovers=self.services.rollout.failovers,
            scorer_failures=failures,
            **(gathered.tools.record() if gathered.tools is not None else {}),
            eval_accuracy=eval_accuracy,
        )

    def _publish(self, record: LogRecord) -> None:
        if self.metrics:
            self.metrics.record(record)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as f:
                f.write(format_record(record) + "\n")
        for sink in self.sinks:
            sink.write(record.step, record.to_json())
        if self.on_step:
            self.on_step(record)

    def _log_generations(self, gathered: Gathered, groups: Sequence[Group]) -> None:
        """A few of the step's responses (fresh and replayed) to `<run dir>/generations.jsonl` and the sinks."""
        count, folder = self.config.logging.generations_per_step, run_dir(self.config)
        if count == 0 or (folder is None and not self.sinks):
            return
        questions = [q.messages[-1][1] for q in gathered.questions]
        rows = generation_log.pick(self.step, questions, [g.trajectories for g in groups], count)
        if folder is not None:
            generation_log.append_jsonl(folder / GENERATIONS_FILE, rows)
        for sink in self.sinks:
            sink.write_generations(self.step, rows)

    def save_checkpoint(self) -> Path:
        ckpt = self.config.checkpoint
        tag = f"step_{self.step}"
        client_state = {
            "step": self.step,
            "policy_version": self.version,
            "cursor": self._trained_cursor or self.cursor.state(),
            "history_run": self.history_run,
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
            "torch_rng": torch.get_rng_state(),
            **self.policy.rng_state(),
        }
        # Before DeepSpeed's state and its `latest`: the step `latest` names always says what it was trained with.
        write_checkpoint_info(ckpt.dir / tag, self.config, self.step)
        self.policy.save_checkpoint(ckpt.dir, tag, client_state)
        self.policy.save_hf(ckpt.dir / tag / "hf", self.model_dir)
        # What the export is: a rollout started from it serves it as this version (rlep.common.policy_info).
        write_policy_info(ckpt.dir / tag / "hf", self.config.run_id, self.step, self.version)
        # Retention: the newest `keep_last` step directories (DeepSpeed state and HF export alike) stay. The new one
        # is complete before an old one goes, so keep_last + 1 exist for the moment in between.
        tags = sorted(
            (p for p in ckpt.dir.glob("step_*") if p.is_dir() and p.name.split("_")[1].isdigit()),
            key=lambda p: int(p.name.split("_")[1]),
        )
        for old in tags[: -ckpt.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return ckpt.dir / tag / "hf"


def _kl_of(batch: ExperienceBatch, estimator: KlEstimator) -> float | None:
    """The old policy's mean KL estimate to the reference over the trained tokens (a KL term in the reward)."""
    if batch.ref_logprobs is None or batch.old_logprobs is None:
        return None
    per_token = kl_estimate(batch.old_logprobs, batch.ref_logprobs, estimator)
    return float((per_token * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1))


def _last_logged_version(log_path: Path | None) -> int:
    """The highest policy version in a step log (0 without one); a line cut short by a crash is skipped."""
    if log_path is None or not log_path.exists():
        return 0
    versions = [0]
    for line in log_path.read_text().splitlines():
        try:
            versions.append(int(json.loads(line)["policy_version"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(versions)


def _tuple_state(state):
    """RNG states come back from a checkpoint with lists where tuples were."""
    if isinstance(state, list):
        return tuple(_tuple_state(s) for s in state)
    return state
