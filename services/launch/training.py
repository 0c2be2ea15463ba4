"""One training run over the services, on Ray (local by default, or a cluster): what `rlep train`, the demo's two
runs and the experiments call."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlep.common.errors import UserError
from rlep.common.ray_local import init_ray
from rlep.services.launch.stack import ServiceStack
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.cursor import load_questions
from rlep.services.learner.pool_seed import seed_pool_from_candidates
from rlep.services.learner.ray_policy import RayPolicy
from rlep.services.learner.records import LogRecord, StepRecord
from rlep.services.learner.tokens import PolicyTokenizer
from rlep.services.learner.tracking import setup_step_sinks
from rlep.services.learner.trainer import Trainer
from rlep.services.verifier.config import ScorerSettings

log = logging.getLogger(__name__)


def policy_tokenizer(model_dir: Path, config: TrainConfig) -> PolicyTokenizer:
    return PolicyTokenizer.load(model_dir, config.data.max_prompt_tokens, config.algorithm.max_response_tokens)


def run_training(
    config: TrainConfig,
    resume: bool = False,
    ray_address: str | None = None,
    stack: ServiceStack | None = None,
    on_step: Callable[[LogRecord], None] | None = None,
    show_progress: bool = True,
    stop_when: Callable[[], bool] | None = None,
) -> list[StepRecord]:
    """Runs `config.steps` steps (from the latest checkpoint with `resume`); returns the step records.

    Pass a started `stack` to share services between runs (the demo's three phases do). `stop_when`, asked
    after every step, ends the run early (e.g. at a plateau); the run then saves a checkpoint of where it stopped.
    """
    from rlep.common.tiny_model import resolve_model

    init_ray(ray_address)
    model_dir = Path(resolve_model(config.model))
    questions = load_questions(config.data.train_files)
    eval_questions = load_questions(config.eval.files) if config.eval.files else []
    say_scorer_routes(config, questions)
    own_stack = stack is None
    stack = stack or ServiceStack(config, model_dir)
    algo = config.algorithm
    services = stack.services if not own_stack else stack.start(algo.replayed_per_question > 0 or algo.online_replay)
    if services.replay is not None and algo.replayed_per_question > 0 and config.data.seed_pool_from_candidates:
        seed_pool_from_candidates(services.replay, config.replay_pool, config.data.train_files)
    statuses = services.rollout.status()
    say_dtypes(config, statuses)
    if problem := logprobs_mode_problem(config.algorithm.logprobs_mode, {s.logprobs_mode for s in statuses}):
        raise UserError(problem)
    policy = RayPolicy(model_dir, config)
    metrics_server = _start_metrics(config)
    trainer, sinks = None, []
    try:
        sinks = setup_step_sinks(config)
        trainer = Trainer(
            config,
            model_dir,
            questions,
            policy,
            services,
            policy_tokenizer(model_dir, config),
            metrics=metrics_server[1] if metrics_server else None,
            eval_questions=eval_questions,
            on_step=on_step,
            sinks=sinks,
        )
        trainer.start(resume)
        console = Console()
        # Output to a file or a pipe (nohup, a pod's log) gets a line per step: a progress bar draws nothing there.
        step_lines = show_progress and not console.is_terminal
        with Progress(
            TextColumn(f"[bold]{config.run_id}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not show_progress or step_lines,
        ) as progress:
            task = progress.add_task("train", total=config.steps, completed=trainer.step, status="")
            records = []
            while trainer.step < config.steps:
                record = trainer.train_step()
                records.append(record)
                status = f"acc {record.fresh_accuracy:.2f} reward {record.reward_mean:+.2f}"
                if record.eval_accuracy is not None:
                    status += f" eval {record.eval_accuracy:.2f}"
                progress.update(task, completed=trainer.step, status=status)
                if step_lines:
                    console.print(
                        f"{config.run_id} step {trainer.step}/{config.steps}: {status}, {record.step_seconds:.1f} s",
                        highlight=False,
                        markup=False,
                        soft_wrap=True,  # one line per step, however long
                    )
                if stop_when is not None and trainer.step < config.steps and stop_when():
                    if config.checkpoint.dir:
                        trainer.save_checkpoint()
                    break
        if metrics_server and config.metrics_linger_s:
            log.info("training done: keeping /metrics up for %g s (metrics_linger_s)", config.metrics_linger_s)
            time.sleep(config.metrics_linger_s)
        return records
    finally:
        if trainer is not None:
            trainer.close()
        policy.close()
        for sink in sinks:
            sink.close()
        if metrics_server:
            metrics_server[0].stop()
        if own_stack:
            stack.close()


def say_scorer_routes(config: TrainConfig, questions) -> None:
    """Logs which training questions the verifier this run starts scores with its default scorer (math-verify unless
    set): a warning when `verifier.scorers` was set (a label it misses is likely a typo), else a note."""
    if config.endpoints.verifier:  # a verifier of its own, whose routes this run does not know
        return
    chosen = config.verifier.scorers != ScorerSettings().scorers
    for line in config.verifier.routing_of(q.data_source for q in questions):
        log.log(logging.WARNING if chosen else logging.INFO, "scorers: %s", line)


LEARNER_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def dtypes_line(learner: str, rollout: set[str]) -> tuple[int, str]:
    """(log level, the line): which dtype each side runs in, and a warning when they differ."""
    served = "/".join(sorted(rollout - {""})) or "unknown"
    line = f"dtypes: the learner trains in {learner}, the rollout replicas sample in {served}"
    if served in (learner, "unknown"):
        return logging.INFO, line
    return logging.WARNING, (
        f"{line}: the sampled logprobs come from a {served} copy of the policy, a train/inference mismatch "
        f"(set local.rollout_engine.dtype={learner} to sample in {learner}, at its cost in speed and memory)"
    )


def say_dtypes(config: TrainConfig, statuses) -> None:
    level, line = dtypes_line(LEARNER_DTYPES[config.deepspeed.dtype], {s.dtype for s in statuses})
    log.log(level, "%s", line)


def logprobs_mode_problem(wanted: str, served: set[str]) -> str | None:
    """Why the replicas' sampled logprobs cannot be compared with the learner's (`algorithm.logprobs_mode`), or None.
    A replica that does not say (an older server) returns vLLM's default, raw logprobs."""
    modes = {mode or "raw_logprobs" for mode in served}
    if modes <= {wanted}:
        return None
    why = (
        "a behavior correction under tempered or top-p sampling weights by the sampling distribution"
        if wanted == "processed_logprobs"
        else "without a tempered behavior correction the learner compares the model's own distribution"
    )
    return (
        f"the rollout replicas return {'/'.join(sorted(modes))} but this run needs {wanted} ({why}): "
        f"start them with engine.logprobs_mode: {wanted}"
    )


def _start_metrics(config: TrainConfig):
    if config.metrics_port is None:
        return None
    from rlep.common.metrics import MetricsServer, service_registry
    from rlep.common.tls import server_ssl_context
    from rlep.services.learner.metrics import LearnerMetrics

    registry = service_registry("learner")
    metrics = LearnerMetrics(registry)
    from rlep.common.files import read_token_file

    token = read_token_file(config.endpoints.auth_token_file)
    ssl_context = server_ssl_context(config.metrics_tls)
    return MetricsServer(registry, config.metrics_host, config.metrics_port, token, ssl_context), metrics
