"""Phase 1 of RLEP as a job: a checkpoint's answers to the training questions, the verified ones into a replay pool.

`collect_pool` wires `rlep.services.learner.collect.collect` to the services: `rlep collect` runs it on a stack of
its own, the demo and the experiments on the stack their training runs share.
"""

from __future__ import annotations

from pathlib import Path

from rlep.common.dataset import Question
from rlep.common.ray_local import init_ray
from rlep.services.launch.stack import ServiceStack
from rlep.services.learner.collect import CollectStats, collect, push_checkpoint
from rlep.services.learner.config import CollectConfig, TrainConfig
from rlep.services.learner.tokens import PolicyTokenizer
from rlep.services.learner.tracking import setup_step_sinks


def collect_pool(
    train: TrainConfig,
    checkpoint: Path,
    questions: list[Question],
    pool: str,
    config: CollectConfig,
    stack: ServiceStack | None = None,
    ray_address: str | None = None,
    state_file: Path | None = None,
    show_progress: bool = True,
) -> CollectStats:
    """Samples `config.samples_per_question` answers per question with `checkpoint` and stores the successes in `pool`.

    With a started `stack` (shared with training runs) its replicas serve other weights, so `checkpoint` is pushed
    to them first. Without one, a stack is started from `train` (on Ray at `ray_address`) for this job alone and
    closed at the end: replicas it starts already serve `checkpoint` (only given ones get a push), and the job's
    progress goes to `train`'s step sinks (`job="collect"`).

    Args:
        train: the run's settings: the services (`endpoints`, `local`), `data.max_prompt_tokens`, the trackers.
        checkpoint: HF directory of the sampling policy; its tokenizer renders the prompts.
        state_file: progress file to resume from (`rlep.services.learner.collect.load_state`); None keeps none.

    Returns:
        the collection's counts (questions kept, samples, successes stored, seconds).
    """
    own_stack = stack is None
    if own_stack:
        init_ray(ray_address)
        stack = ServiceStack(train, checkpoint)
        stack.start(need_replay=True)
    services, sinks = stack.services, []
    try:
        if own_stack:
            sinks = setup_step_sinks(train, job="collect")
        if not own_stack or train.endpoints.rollout or train.endpoints.rollout_service:
            push_checkpoint(services.rollout, checkpoint)
        tokenizer = PolicyTokenizer.load(checkpoint, train.data.max_prompt_tokens, config.max_response_tokens)
        return collect(
            services,
            questions,
            pool,
            config,
            state_file=state_file,
            show_progress=show_progress,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            sinks=sinks,
            tools=train.tools,  # the run's tools: its phase-1 pool holds traces its replay can train on
        )
    finally:
        for sink in sinks:
            sink.close()
        if own_stack:
            stack.close()
