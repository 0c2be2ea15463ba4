"""Phase 1 of RLEP: sample many answers per training question with a trained policy, keep the verified ones.

`rlep collect --model CKPT --data train.parquet --pool NAME`: N samples per question (paper: 64 at
T=0.7, top-p 0.95), scored by the verifier; a question's successes go to the replay pool when it
has at least `min_successes` of them (paper: 2), else the question is dropped. Questions go in
chunks; a small state file records the chunks done, so a rerun after a crash continues where it
stopped (and replay's adds are idempotent, so a chunk done twice stores nothing twice).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import Field
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlep_common.config import StrictModel
from rlep_common.types import Source, Trajectory, Verdict
from services.learner.data import Question
from services.learner.trainer import Services
from services.rollout.types import Sampling


class CollectConfig(StrictModel):
    samples_per_question: int = Field(64, ge=1)
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_response_tokens: int = Field(20480, ge=1)
    min_successes: int = Field(2, ge=1)
    """Questions with fewer verified successes are left out of the pool."""
    questions_per_chunk: int = Field(64, ge=1)
    seed: int = 0
    run_id: str = "collect"


@dataclass
class CollectStats:
    questions: int = 0
    questions_kept: int = 0
    samples: int = 0
    successes: int = 0
    successes_stored: int = 0
    chunks_done: int = 0
    seconds: float = 0.0

    @property
    def success_rate(self) -> float:
        return self.successes / self.samples if self.samples else 0.0


def collect(
    services: Services,
    questions: list[Question],
    pool: str,
    config: CollectConfig,
    state_file: Path | None = None,
    show_progress: bool = True,
) -> CollectStats:
    """Samples, verifies and stores successes chunk by chunk; resumes from `state_file` when it exists."""
    stats = CollectStats()
    if state_file and state_file.exists():
        stats = CollectStats(**json.loads(state_file.read_text()))
    chunks = [
        questions[i : i + config.questions_per_chunk] for i in range(0, len(questions), config.questions_per_chunk)
    ]
    started = time.perf_counter() - stats.seconds
    with Progress(
        TextColumn("[bold]collect"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("success rate {task.fields[rate]:.1%} · kept {task.fields[kept]} questions"),
        TimeElapsedColumn(),
        disable=not show_progress,
    ) as progress:
        task = progress.add_task(
            "collect",
            total=len(questions),
            completed=sum(len(c) for c in chunks[: stats.chunks_done]),
            rate=stats.success_rate,
            kept=stats.questions_kept,
        )
        for index in range(stats.chunks_done, len(chunks)):
            _collect_chunk(services, chunks[index], pool, config, index, stats)
            stats.chunks_done = index + 1
            stats.seconds = time.perf_counter() - started
            if state_file:
                state_file.parent.mkdir(parents=True, exist_ok=True)
                state_file.write_text(json.dumps(asdict(stats)))
            progress.update(task, advance=len(chunks[index]), rate=stats.success_rate, kept=stats.questions_kept)
    return stats


def _collect_chunk(
    services: Services, chunk: list[Question], pool: str, config: CollectConfig, index: int, stats: CollectStats
) -> None:
    completions = services.rollout.generate(
        [q.chat() for q in chunk],
        Sampling(
            n=config.samples_per_question,
            temperature=config.temperature,
            top_p=config.top_p,
            max_tokens=config.max_response_tokens,
            seed=config.seed * 1_000_003 + index,
        ),
    )
    items = [(s.text, q.ground_truth) for q, c in zip(chunk, completions, strict=True) for s in c.samples]
    outcomes = iter(services.verifier.verify(items))
    keep: list[Trajectory] = []
    now_ms = int(time.time() * 1000)
    for question, completion in zip(chunk, completions, strict=True):
        successes = []
        for sample in completion.samples:
            outcome = next(outcomes)
            if outcome.verdict != Verdict.CORRECT:
                continue
            successes.append(
                Trajectory(
                    question_id=question.question_id,
                    response_text=sample.text,
                    reward=outcome.reward,
                    source=Source.REPLAY,
                    verdict=Verdict.CORRECT,
                    policy_version=sample.policy_version,
                    finish_reason=sample.finish_reason,
                    prompt_token_ids=tuple(completion.prompt_token_ids),
                    response_token_ids=tuple(sample.token_ids),
                    behavior_logprobs=tuple(sample.logprobs),
                    run_id=config.run_id,
                    created_at_ms=now_ms,
                )
            )
        stats.questions += 1
        stats.samples += len(completion.samples)
        stats.successes += len(successes)
        # Distinct texts: identical answers are one success in the pool (ids hash the text).
        distinct = len({t.response_text for t in successes})
        if distinct >= config.min_successes:
            stats.questions_kept += 1
            keep.extend(successes)
    if keep:
        reply = services.replay.add(pool, keep)
        stats.successes_stored += reply.added


def push_checkpoint(rollout, model_dir: Path) -> int:
    """Serves a checkpoint's weights on every replica as a new version; returns that version."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(file)))
    version = max(rollout.versions()) + 1
    rollout.push_weights(state, version)
    return version
