"""Phase 1 of RLEP: sample many answers per training question with a trained policy, keep the verified ones.

`rlep collect --model CKPT --data train.parquet --pool NAME`: N samples per question (paper: 64 at
T=0.7, top-p 0.95), scored by the verifier; a question's successes go to the replay pool when it
has at least `min_successes` of them (paper: 2), else the question is dropped. Questions go in
chunks; a small state file records the chunks done, so a rerun after a crash continues where it
stopped (and replay's adds are idempotent, so a chunk done twice stores nothing twice).

The state file also records the run's settings (`run_settings`: checkpoint, questions, pool and every
`CollectConfig` field) and their fingerprint. A state written under other settings is never resumed:
`load_state` refuses it and names what differs, and `rlep collect`'s default state path carries the
fingerprint, so another checkpoint or other settings start their own file. The checkpoint counts by
its files' names, sizes and modification times (hashing a 7B checkpoint's weights would take minutes):
a copied checkpoint counts as another one, which costs a re-collection but never skips one.
Not in the fingerprint: the engine and verifier settings (dtype, max_model_len, timeouts).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlep.common.dataset import Question
from rlep.common.files import load_safetensors
from rlep.common.policy_info import policy_version_of
from rlep.common.types import Source, Trajectory, Verdict
from rlep.services.learner.config import CollectConfig
from rlep.services.learner.scored_trajectories import sampled_trajectories
from rlep.services.learner.step_inputs import ServiceClients, verify_episodes
from rlep.services.learner.tokens import PolicyTokenizer
from rlep.services.learner.tool_rollouts import ToolUseConfig, is_void, run_episodes, trace_environment
from rlep.services.learner.tracking import StepSink
from rlep.services.rollout.types import Sampling
from rlep.services.verifier.client import verify_groups

STATE_DIR = Path.home() / ".cache" / "rlep" / "collect"


def keeps_question(
    success_texts: list[str], min_successes: int, rule: Literal["distinct", "correct"] = "distinct"
) -> bool:
    """Whether a question with these verified successes goes to the pool (`CollectConfig.keep_rule`)."""
    count = len(set(success_texts)) if rule == "distinct" else len(success_texts)
    return count >= min_successes


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


class StateMismatch(ValueError):
    """A state file written under other settings than this run's; the message names what differs."""


def checkpoint_identity(checkpoint: Path | str | None) -> str:
    """sha256 over a checkpoint directory's top-level files (name, size, mtime); else the name itself."""
    if checkpoint is None or not Path(checkpoint).is_dir():
        return str(checkpoint or "")
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(checkpoint).iterdir() if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def run_settings(
    config: CollectConfig,
    questions: list[Question],
    pool: str,
    checkpoint: Path | str | None = None,
    tools: ToolUseConfig | None = None,
) -> dict[str, Any]:
    """Everything that changes what a collection stores, as a JSON-able dict (see the module docstring)."""
    content = json.dumps([[q.question_id, q.messages, q.ground_truth] for q in questions])
    # The default rule stays out of the settings: states written before `keep_rule` existed keep their fingerprint.
    default_rule = {"keep_rule"} if config.keep_rule == "distinct" else None
    return {
        **config.model_dump(mode="json", exclude=default_rule),
        "pool": pool,
        "checkpoint": checkpoint_identity(checkpoint),
        "questions": f"{len(questions)} questions, sha256 {hashlib.sha256(content.encode()).hexdigest()}",
        **({"tools": tools.model_dump(mode="json")} if tools is not None else {}),  # absent: older states resume
    }


def fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def default_state_file(pool: str, settings: dict[str, Any]) -> Path:
    """`~/.cache/rlep/collect/<pool>-<fingerprint[:12]>.json`: one file per pool and settings."""
    return STATE_DIR / f"{pool}-{fingerprint(settings)[:12]}.json"


def load_state(state_file: Path | None, settings: dict[str, Any]) -> CollectStats:
    """The progress saved in `state_file` (fresh when absent); raises StateMismatch for other settings."""
    if state_file is None or not state_file.exists():
        return CollectStats()
    saved = json.loads(state_file.read_text())
    if "fingerprint" not in saved:
        raise StateMismatch(f"{state_file} records no settings (older rlep): delete it or pass another --state-file")
    if saved["fingerprint"] != fingerprint(settings):
        before = saved.get("settings", {})
        changed = [
            key if key in ("checkpoint", "questions") else f"{key} {before.get(key)!r} -> {settings.get(key)!r}"
            for key in sorted(before.keys() | settings.keys())
            if before.get(key) != settings.get(key)
        ]
        raise StateMismatch(
            f"{state_file} holds the progress of a collection with other settings ({'; '.join(changed)}); "
            "rerun with the same settings to resume it, or pass another --state-file to start anew"
        )
    return CollectStats(**{f.name: saved[f.name] for f in fields(CollectStats) if f.name in saved})


def collect(
    services: ServiceClients,
    questions: list[Question],
    pool: str,
    config: CollectConfig,
    state_file: Path | None = None,
    show_progress: bool = True,
    checkpoint: Path | str | None = None,
    tokenizer: PolicyTokenizer | None = None,
    sinks: Sequence[StepSink] = (),
    tools: ToolUseConfig | None = None,
) -> CollectStats:
    """Samples, verifies and stores successes chunk by chunk; with `tools` (and `tokenizer`, and a sandbox in
    `services.run_code`), multi-turn tool episodes whose successes are stored as whole traces (issue 50; an episode
    ending in a void turn is not stored, whatever it answered).

    Resumes from `state_file` when it holds a run with the same `run_settings` (the sampled
    `checkpoint` among them); raises StateMismatch when it holds another. With `tokenizer` (the sampled
    policy's), prompts are rendered and left-truncated as in training and successes carry its
    fingerprint, so a learner with the same tokenizer trains on their ids as sampled. After each chunk the
    stats (the state file's names, plus `success_rate`) go to `sinks` at step `chunks_done`.
    """
    settings = run_settings(config, questions, pool, checkpoint, tools)
    if tools is not None and (tokenizer is None or services.run_code is None):
        raise ValueError("collecting tool traces needs the policy's tokenizer and a sandbox (ServiceClients.run_code)")
    stats = load_state(state_file, settings)
    if tokenizer is not None:  # prompt + max_response_tokens must fit every replica's model
        tokenizer.fit_model_length(services.rollout.max_model_len())
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
            _collect_chunk(services, chunks[index], pool, config, index, stats, tokenizer, tools)
            stats.chunks_done = index + 1
            stats.seconds = time.perf_counter() - started
            if state_file:
                state_file.parent.mkdir(parents=True, exist_ok=True)
                state = {**asdict(stats), "fingerprint": fingerprint(settings), "settings": settings}
                state_file.write_text(json.dumps(state, indent=1))
            for sink in sinks:
                sink.write(stats.chunks_done, {**asdict(stats), "success_rate": stats.success_rate})
            progress.update(task, advance=len(chunks[index]), rate=stats.success_rate, kept=stats.questions_kept)
    return stats


def _collect_chunk(
    services: ServiceClients,
    chunk: list[Question],
    pool: str,
    config: CollectConfig,
    index: int,
    stats: CollectStats,
    tokenizer: PolicyTokenizer | None,
    tools: ToolUseConfig | None = None,
) -> None:
    prompts = [tokenizer.encode_prompt(q.chat()).token_ids if tokenizer else q.chat() for q in chunk]
    sampling = Sampling(
        n=config.samples_per_question,
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_response_tokens,
        seed=config.seed * 1_000_003 + index,
    )
    if tools is None:
        sampled_groups = _sampled(services, chunk, prompts, sampling, config, tokenizer)
    else:
        sampled_groups = _sampled_traces(services, chunk, prompts, sampling, config, tokenizer, tools)
    keep: list[Trajectory] = []
    for sampled in sampled_groups:
        successes = [t for t in sampled if t.verdict == Verdict.CORRECT]
        stats.questions += 1
        stats.samples += config.samples_per_question
        stats.successes += len(successes)
        # Identical answers are one success in the pool (ids hash the text), whatever the rule counts.
        if keeps_question([t.response_text for t in successes], config.min_successes, config.keep_rule):
            stats.questions_kept += 1
            keep.extend(successes)
    if keep:
        reply = services.replay.add(pool, keep)
        stats.successes_stored += reply.added


def _sampled(services, chunk, prompts, sampling, config: CollectConfig, tokenizer) -> list[list[Trajectory]]:
    completions = services.rollout.generate(prompts, sampling)
    groups = [(q.ground_truth, [s.text for s in c.samples]) for q, c in zip(chunk, completions, strict=True)]
    verified = verify_groups(services.verifier, groups, [q.data_source for q in chunk])
    fingerprint = tokenizer.fingerprint if tokenizer else ""
    return [
        sampled_trajectories(
            question.question_id,
            completion.prompt_token_ids,
            completion.samples,
            outcomes,
            Source.REPLAY,
            config.run_id,
            fingerprint,
        )
        for question, completion, outcomes in zip(chunk, completions, verified, strict=True)
    ]


def _sampled_traces(
    services, chunk, prompts, sampling, config: CollectConfig, tokenizer: PolicyTokenizer, tools: ToolUseConfig
) -> list[list[Trajectory]]:
    """Tool episodes as traces, verified on the policy's tokens; void ones left out (SimpleTIR: no signal)."""
    hf = tokenizer.tokenizer
    episodes = run_episodes(prompts, sampling, services.rollout.generate, services.run_code, hf, tools.loop)
    texts, verified = verify_episodes(services.verifier, chunk, episodes, hf)
    env = trace_environment(hf, tools)
    return [
        [
            episode.to_trajectory(
                question.question_id,
                text,
                outcome.reward,
                verdict=outcome.verdict,
                source=Source.REPLAY,
                run_id=config.run_id,
                tokenizer_fingerprint=tokenizer.fingerprint,
                **env,
            )  # fmt: skip
            for episode, text, outcome in zip(group, group_texts, outcomes, strict=True)
            if not is_void(episode, outcome.verdict)
        ]
        for question, group, group_texts, outcomes in zip(chunk, episodes, texts, verified, strict=True)
    ]


def push_checkpoint(rollout, model_dir: Path) -> int:
    """Serves a checkpoint's weights on every replica as a new version; returns that version: the one the
    checkpoint records (`rlep-policy.json`) when the replicas serve an older one, else one above theirs."""
    state = load_safetensors(sorted(Path(model_dir).glob("*.safetensors")))
    version = max(max(rollout.versions()) + 1, policy_version_of(model_dir))
    rollout.push_weights(state, version)
    return version
