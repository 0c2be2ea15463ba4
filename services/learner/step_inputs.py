"""What one training step trains on: generation rounds (with DAPO's dynamic sampling) and replayed answers.

`StepInputs.gather` takes questions from the cursor, renders them with the policy's tokenizer, has
rollout sample G answers each and the verifier score them; with dynamic sampling it drops groups
whose rewards are all equal and generates further rounds until B groups are kept (at most
`max_rounds`). `StepInputs.replayed` asks replay for M successes per kept question and lays them out
and scores them like fresh answers. Both report what they did (`Gathered`, `ReplayReport`), and the
step record carries it: nothing here fails silently.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from rlep.common.dataset import Question
from rlep.common.types import Trajectory
from rlep.replay.v1 import replay_pb2
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.cursor import DataCursor
from rlep.services.learner.metrics import PHASES
from rlep.services.learner.replay_rules import FreshOutcome, decide
from rlep.services.learner.scored_trajectories import (
    ReplayReport,
    TraceRules,
    group_varies,
    prepare_replayed,
    score_fresh,
    score_replayed,
    shaped_reward,
    within_token_share,
)
from rlep.services.learner.tokens import EncodedPrompt, PolicyTokenizer
from rlep.services.learner.tool_rollouts import (
    RunCode,
    ToolEpisode,
    ToolFigures,
    is_void,
    run_episodes,
    trace_environment,
)
from rlep.services.replay.types import PoolNotFound
from rlep.services.rollout.types import Sampling
from rlep.services.verifier.client import verify_groups

if TYPE_CHECKING:
    from rlep.services.replay.client import ReplayClient
    from rlep.services.rollout.client import RolloutClient
    from rlep.services.verifier.client import VerifierClient

log = logging.getLogger(__name__)


@dataclass
class ServiceClients:
    """The clients a run talks to (fakes of the same shape in unit tests)."""

    rollout: RolloutClient
    verifier: VerifierClient
    replay: ReplayClient | None
    """Needed when M > 0 or online replay is on."""
    run_code: RunCode | None = None
    """The tool sandbox's `run(code, caller)`; needed with `tools` on (the launch room starts one in process)."""


@dataclass
class StepTimer:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started


def step_seed(seed: int, step: int, round_index: int = 0) -> int:
    key = f"{seed}:{step}" if round_index == 0 else f"{seed}:{step}:{round_index}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") & 0x7FFFFFFF


class ReplayMissingError(RuntimeError):
    """M > 0, `require_replay` is on, and a step got no replayed answer at all."""


@dataclass
class Gathered:
    """The questions a step trains on, their prompts and scored fresh groups, and how they were got."""

    questions: list[Question] = field(default_factory=list)
    prompts: list[EncodedPrompt] = field(default_factory=list)
    fresh: list[list[Trajectory]] = field(default_factory=list)
    rounds: int = 0
    questions_generated: int = 0
    prompts_truncated: int = 0
    groups_filtered: int = 0
    cursor_state: dict[str, int] = field(default_factory=dict)
    """The data cursor right after this step's draws: what a checkpoint taken after this step resumes from
    (the cursor itself may have moved on, when later steps were gathered ahead)."""
    outcomes: list[FreshOutcome] = field(default_factory=list)
    """Every group generated for the step, kept or filtered by dynamic sampling: what the replay service's
    per-question history is told."""
    tools: ToolFigures | None = None
    """With `tools` on: the step's tool episodes, every round's."""


def verify_episodes(
    verifier, questions: Sequence[Question], episodes: list[list[ToolEpisode]], hf
) -> tuple[list, list]:
    """Each episode's whole text (tool outputs included: what the trajectory shows) and the verifier's outcome on
    its policy's own tokens, every turn's (a tool output that prints `\\boxed{42}` is not the policy's answer)."""
    texts = [[hf.decode(e.response_token_ids, skip_special_tokens=True) for e in group] for group in episodes]
    answers = [[hf.decode(e.policy_token_ids, skip_special_tokens=True) for e in group] for group in episodes]
    groups = [(q.ground_truth, group) for q, group in zip(questions, answers, strict=True)]
    return texts, verify_groups(verifier, groups, [q.data_source for q in questions])


class StepInputs:
    def __init__(
        self,
        config: TrainConfig,
        questions: list[Question],
        cursor: DataCursor,
        services: ServiceClients,
        tokenizer: PolicyTokenizer,
    ):
        self.config, self.questions, self.cursor = config, questions, cursor
        self.services, self.tokenizer = services, tokenizer
        self.trace_env: dict[str, str] = {}
        """`trace_environment`: the hashes of the traces this learner writes and replays (empty without tools)."""
        if config.tools is not None:
            if services.run_code is None:
                raise ValueError("tools are on but no sandbox was given (ServiceClients.run_code)")
            self.trace_env = trace_environment(tokenizer.tokenizer, config.tools)

    def gather(self, step: int, timer: StepTimer) -> Gathered:
        """B questions with their scored fresh groups; with dynamic sampling, only groups whose rewards vary.

        `step` is the step's 0-based index (it seeds the sampling); logs name step `step + 1`, as its record does.
        """
        algo = self.config.algorithm
        dynamic = algo.dynamic_sampling
        per_round = (
            (dynamic.questions_per_round or algo.questions_per_step) if dynamic.enabled else algo.questions_per_step
        )
        kept, last = Gathered(), Gathered()
        for round_index in range(dynamic.max_rounds if dynamic.enabled else 1):
            last = self._generate_round(step, round_index, per_round, timer)
            kept.rounds += 1
            kept.questions_generated += len(last.questions)
            kept.prompts_truncated += last.prompts_truncated
            if last.tools is not None:
                kept.tools = kept.tools or ToolFigures()
                kept.tools.add_figures(last.tools)
            for question, prompt, fresh in zip(last.questions, last.prompts, last.fresh, strict=True):
                kept.outcomes.append(FreshOutcome.of(question.question_id, fresh))
                if dynamic.enabled and not group_varies(fresh, dynamic.metric):
                    kept.groups_filtered += 1
                    continue
                kept.questions.append(question)
                kept.prompts.append(prompt)
                kept.fresh.append(fresh)
            if len(kept.questions) >= algo.questions_per_step:
                break
        if len(kept.questions) < algo.questions_per_step:
            log.warning(
                "step %d: dynamic sampling kept %d of %d groups after %d rounds (max_rounds); training on %s",
                step + 1,
                len(kept.questions),
                algo.questions_per_step,
                kept.rounds,
                "them" if kept.questions else "the last round's groups, whose advantages are all zero",
            )
            if not kept.questions:
                kept.questions, kept.prompts, kept.fresh = last.questions, last.prompts, last.fresh
        limit = algo.questions_per_step
        kept.questions, kept.prompts, kept.fresh = kept.questions[:limit], kept.prompts[:limit], kept.fresh[:limit]
        kept.cursor_state = self.cursor.state()
        return kept

    def _generate_round(self, step: int, round_index: int, count: int, timer: StepTimer) -> Gathered:
        algo = self.config.algorithm
        questions = [self.questions[i] for i in self.cursor.next_indices(count)]
        prompts = [self.tokenizer.encode_prompt(q.chat()) for q in questions]
        sampling = Sampling(
            n=algo.fresh_per_question,
            temperature=algo.temperature,
            top_p=algo.top_p,
            max_tokens=algo.max_response_tokens,
            seed=step_seed(self.config.seed, step, round_index),
        )
        if self.config.tools is not None:
            fresh, figures = self._tool_round(questions, prompts, sampling, timer)
            return Gathered(questions, prompts, fresh, prompts_truncated=self._truncated(step, prompts), tools=figures)
        with timer.phase("rollout"):
            completions = self.services.rollout.generate([p.token_ids for p in prompts], sampling)
        with timer.phase("verify"):
            groups = [
                (q.ground_truth, [s.text for s in c.samples]) for q, c in zip(questions, completions, strict=True)
            ]
            outcomes = verify_groups(self.services.verifier, groups, [q.data_source for q in questions])
            fresh = [
                score_fresh(q.question_id, p, c, o, algo, self.config.run_id, self.tokenizer.fingerprint)
                for q, p, c, o in zip(questions, prompts, completions, outcomes, strict=True)
            ]
        return Gathered(questions, prompts, fresh, prompts_truncated=self._truncated(step, prompts))

    def _truncated(self, step: int, prompts: list[EncodedPrompt]) -> int:
        truncated = sum(p.truncated_tokens > 0 for p in prompts)
        if truncated:
            log.warning(
                "step %d: %d of %d prompts were left-truncated to %d tokens",
                step + 1,
                truncated,
                len(prompts),
                self.tokenizer.max_prompt_tokens,
            )
        return truncated

    def _tool_round(
        self, questions: list[Question], prompts: list[EncodedPrompt], sampling: Sampling, timer: StepTimer
    ) -> tuple[list[list[Trajectory]], ToolFigures]:
        """G tool episodes per question (tool_rollouts.py), verified on the policy's own tokens (a tool output is not
        its answer) and scored like single answers; the sandbox's time counts as rollout."""
        algo, tools = self.config.algorithm, self.config.tools
        hf = self.tokenizer.tokenizer
        with timer.phase("rollout"):
            episodes = run_episodes(
                [p.token_ids for p in prompts],
                sampling,
                self.services.rollout.generate,
                self.services.run_code,
                hf,
                tools.loop,
            )
        figures = ToolFigures()
        with timer.phase("verify"):
            texts, outcomes = verify_episodes(self.services.verifier, questions, episodes, hf)
            now_ms = int(time.time() * 1000)
            fresh = []
            figures.void_turns = tools.void_turns
            for question, group, group_texts, verdicts in zip(questions, episodes, texts, outcomes, strict=True):
                figures.add(group)
                trajectories = []
                for episode, text, o in zip(group, group_texts, verdicts, strict=True):
                    reward, void = shaped_reward(o.reward, len(episode.response_token_ids), algo), False
                    if is_void(episode, o.verdict):
                        figures.void_episodes += 1
                        void = tools.void_turns == "filter"
                        reward -= tools.void_penalty if tools.void_turns == "penalize" else 0.0
                    trajectories.append(episode.to_trajectory(
                        question.question_id, text, reward, verdict=o.verdict, run_id=self.config.run_id,
                        created_at_ms=now_ms, tokenizer_fingerprint=self.tokenizer.fingerprint, excluded_from_loss=void,
                        **self.trace_env,
                    ))  # fmt: skip
                fresh.append(trajectories)
        return fresh, figures

    def _replay_count(self) -> int:
        algo = self.config.algorithm
        m = algo.replayed_per_question
        if algo.max_replayed_fraction is not None and algo.max_replayed_fraction < 1:
            # replayed / (G + replayed) <= cap  =>  replayed <= cap * G / (1 - cap)
            cap = algo.max_replayed_fraction
            m = min(m, int(cap * algo.fresh_per_question / (1 - cap)))
        return m

    def replayed(
        self, step: int, gathered: Gathered, report: ReplayReport, timer: StepTimer, policy_version: int = 0
    ) -> dict[str, list[Trajectory]]:
        """Up to M stored successes per question, re-tokenised and scored like fresh samples; `report` says how many.
        `step` is the 0-based index, as in `gather`. With tools on, stored tool traces are replayed as stored where
        their environment matches (`TraceRules`; `policy_version`, the weights being trained, bounds the staleness
        of this run's own), and replayed rows stay within `tools.replay.max_token_fraction` of the step's tokens."""
        algo, m = self.config.algorithm, self._replay_count()
        if algo.replayed_per_question == 0:
            return {}
        replayed: dict[str, list[Trajectory]] = {}
        with timer.phase("replay"):
            offered = self._offered(gathered, report)
            report.requested = m * len(offered)
            try:
                sampled = {}
                if offered:
                    sampled = self.services.replay.sample(
                        self.config.replay_pool,
                        offered,
                        m=m,
                        strategy=algo.replay_strategy,
                        seed=step_seed(self.config.seed + 7919, step),
                    )
            except PoolNotFound:
                report.dropped["pool_missing"] += report.requested
                sampled = {}
            prompts = {q.question_id: p for q, p in zip(gathered.questions, gathered.prompts, strict=True)}
            replayed = prepare_replayed(sampled, prompts, self.tokenizer, report, self._trace_rules(policy_version))
            if self.config.tools is not None:
                fresh_tokens = sum(len(t.response_token_ids) for group in gathered.fresh for t in group)
                share = self.config.tools.replay.max_token_fraction
                replayed = within_token_share(replayed, fresh_tokens, share, report)
        report.dropped["not_in_pool"] += report.requested - report.received - report.dropped["pool_missing"]
        outcomes = None
        if replayed and algo.reverify_replayed:
            with timer.phase("verify"):
                asked = {q.question_id: q for q in gathered.questions}
                groups = [
                    (asked[qid].ground_truth, [self._policy_text(t) for t in rows]) for qid, rows in replayed.items()
                ]
                sources = [asked[qid].data_source for qid in replayed]
                outcomes = dict(zip(replayed, verify_groups(self.services.verifier, groups, sources), strict=True))
        replayed = score_replayed(replayed, outcomes, algo, report)
        report.dropped = +report.dropped  # keep only reasons that happened
        fresh_successes = {o.question_id: o.successes for o in gathered.outcomes}
        report.rescued_groups = sum(bool(rows) and fresh_successes.get(qid) == 0 for qid, rows in replayed.items())
        if not report.offered:
            log.info("step %d: the replay rule let replay into no group: %s", step + 1, dict(report.skipped))
        elif report.used == 0:
            message = (
                f"replay is on (M={algo.replayed_per_question}) but step {step + 1} got no replayed answer from pool "
                f"{self.config.replay_pool!r}: {dict(report.dropped) or 'nothing returned'}"
            )
            if algo.require_replay:
                raise ReplayMissingError(message)
            log.warning(message)
        return replayed

    def _trace_rules(self, policy_version: int) -> TraceRules | None:
        tools = self.config.tools
        if tools is None:
            return None  # stored traces are dropped: this run would train on their tool outputs
        return TraceRules(**self.trace_env, run_id=self.config.run_id, policy_version=policy_version,
                          max_staleness=tools.replay.max_staleness)  # fmt: skip

    def _policy_text(self, t: Trajectory) -> str:
        """What a row's answer is read from: a tool trace's policy tokens (a tool output is not its answer)."""
        if not t.response_mask:
            return t.response_text
        ids = [token for token, mine in zip(t.response_token_ids, t.response_mask, strict=True) if mine]
        return self.tokenizer.tokenizer.decode(ids, skip_special_tokens=True)

    def _offered(self, gathered: Gathered, report: ReplayReport) -> list[str]:
        """The step's questions the replay rule lets replay into (all of them under `always`, as before rules)."""
        rule = self.config.algorithm.replay_rule
        ids = [q.question_id for q in gathered.questions]
        if rule.when == "always" and rule.retire_pass_rate is None:
            report.offered = len(ids)
            return ids
        histories = {}
        if rule.needs_history:
            try:
                found = self.services.replay.question_stats(self.config.replay_pool, question_ids=ids).questions
                histories = {h.question_id: h for h in found}
            except PoolNotFound:
                pass  # counted by the Sample call that follows
        by_id = {o.question_id: o for o in gathered.outcomes}
        decision = decide(rule, [by_id[qid] for qid in ids], histories)
        report.offered, report.skipped = len(decision.offered), decision.skipped
        return decision.offered

    def report_outcomes(
        self,
        run: str,
        step_number: int,
        gathered: Gathered,
        replayed: dict[str, list[Trajectory]],
        report: ReplayReport,
    ) -> None:
        """Tells the replay service's per-question history what step `step_number` (1-based, as its record) of `run`
        saw: every generated group's fresh outcome, with the replayed rows it got. Never fails the step: what
        happened goes to `report` (and a warning where it did not record)."""
        algo = self.config.algorithm
        replay_on = algo.replayed_per_question > 0 or algo.online_replay  # a baseline (M=0) has no pool to tell
        outcomes = merged_outcomes(gathered.outcomes, replayed)
        if self.services.replay is None or not algo.replay_rule.report_outcomes or not replay_on or not outcomes:
            return
        try:
            reply = self.services.replay.report_outcomes(
                self.config.replay_pool,
                run,
                step_number,
                max(o.policy_version for o in gathered.outcomes),
                outcomes,
            )
        except PoolNotFound:
            report.history_status, report.history_recorded = "pool_missing", 0
        except grpc.RpcError as err:
            report.history_status, report.history_recorded = f"failed: {err.code().name}", 0
        else:
            report.history_status = "duplicate" if reply.duplicate else "recorded"
            report.history_recorded = reply.recorded
        if report.history_status not in ("recorded", "duplicate"):
            log.warning(
                "step %d: per-question history not recorded in pool %r (%s)",
                step_number, self.config.replay_pool, report.history_status,
            )  # fmt: skip

    def update_priorities(self, updates: list[tuple[str, str, float]], report: ReplayReport) -> None:
        """Sets the replayed successes' priorities (`replay_priority: policy_surprise`). Never fails the step: what
        happened goes to `report`, with a warning where nothing was set."""
        if not updates:  # on, but this step replayed nothing: the record says so
            report.priorities_status, report.priorities_updated = "no_replayed_rows", 0
            return
        try:
            updated, missing = self.services.replay.update_priorities(self.config.replay_pool, updates)
        except PoolNotFound:
            report.priorities_status, report.priorities_updated = "pool_missing", 0
        except grpc.RpcError as err:
            report.priorities_status, report.priorities_updated = f"failed: {err.code().name}", 0
        else:
            report.priorities_status, report.priorities_updated = "updated", updated
            if missing:  # evicted or dropped since this step drew them
                log.info("%d of %d replayed successes left the pool: priority not set", missing, len(updates))
        if report.priorities_status != "updated":  # the pool is gone, or the service refused
            log.warning("replay priorities not set in pool %r (%s)", self.config.replay_pool, report.priorities_status)


def merged_outcomes(
    outcomes: list[FreshOutcome], replayed: dict[str, list[Trajectory]]
) -> list[replay_pb2.QuestionOutcome]:
    """One `QuestionOutcome` per question (a question drawn twice in a step, in two rounds, counts once, summed)."""
    merged: dict[str, replay_pb2.QuestionOutcome] = {}
    for o in outcomes:
        if not o.attempts:
            continue
        into = merged.setdefault(o.question_id, replay_pb2.QuestionOutcome(question_id=o.question_id))
        reward_sum = into.mean_reward * into.attempts + o.mean_reward * o.attempts
        into.attempts += o.attempts
        into.successes += o.successes
        into.mean_reward = reward_sum / into.attempts
    for qid, into in merged.items():
        into.replayed = len(replayed.get(qid, ()))
        into.rescued = into.replayed > 0 and into.successes == 0
    return list(merged.values())
