"""The checks of a replay request, with no gRPC around them: pool names, question ids, counts and bounds.

Each check raises `InvalidRequest` (the service answers INVALID_ARGUMENT and does nothing) or, for a request
that is well-formed but would cost more than a configured bound, `LimitExceeded` (RESOURCE_EXHAUSTED), before
any work. A trajectory that cannot be stored does not fail its add: `trajectory_problem` gives the reason the
reply lists it under, and the rest of the add goes ahead.

Requests arrive as the proto messages of `rlep.replay.v1` (this module reads their fields, as rollout's
`requests` does), so the server only hands them over and maps the errors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.question_history import (
    FLOAT_FIELDS,
    MAX_WINDOW,
    RECORD_FIELDS,
    Outcome,
    QuestionFilter,
    QuestionQuery,
    QuestionRecord,
)
from rlep.services.replay.sampling import Strategy

# Matched whole (`fullmatch`): `$` alone lets a trailing newline through ("base\n" would be a pool of its own).
POOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_QUESTION_ID_CHARS = 256
MAX_FINGERPRINT_CHARS = 64
MAX_TOOL_CALLS = 64  # a trace's calls (the tool loop's max_calls is at most 64)
# An export chunk holds at most this many questions (the server also cuts a chunk by bytes).
MAX_QUESTIONS_PER_CHUNK = 4096
DEFAULT_QUESTIONS_PER_CHUNK = 256
STRATEGIES = {
    replay_pb2.STRATEGY_UNSPECIFIED: Strategy.UNIFORM,
    replay_pb2.UNIFORM: Strategy.UNIFORM,
    replay_pb2.RECENCY: Strategy.RECENCY,
    replay_pb2.PRIORITIZED: Strategy.PRIORITIZED,
    replay_pb2.DIVERSE: Strategy.DIVERSE,
}


# History: a run id names one training run; steps and versions stay exact in Redis's Lua (doubles); rewards are
# bounded so sums over a question's attempts stay finite (DAPO's rewards are -1 when wrong: sign is free).
RUN_ID = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
MAX_STEP = 2**53 - 1
MAX_ATTEMPTS = 1 << 20
MAX_ABS_REWARD = 1e6
DEFAULT_QUESTION_PAGE = 100
MAX_QUESTION_PAGE = 1000
CURSOR = re.compile(r"[0-9a-f]{16}:(.+)", re.DOTALL)  # history.py's index members: "<rate hex>:<question id>"
QUESTION_FILTERS = {
    replay_pb2.QUESTION_FILTER_UNSPECIFIED: QuestionFilter.ALL,
    replay_pb2.PASS_RATE_BAND: QuestionFilter.BAND,
    replay_pb2.NEVER_SOLVED: QuestionFilter.NEVER_SOLVED,
    replay_pb2.MASTERED: QuestionFilter.MASTERED,
}


class InvalidRequest(ValueError):
    """A request the service refuses as malformed (INVALID_ARGUMENT); the message names the field."""


class LimitExceeded(Exception):
    """A request would cost more than a configured bound (the service answers RESOURCE_EXHAUSTED)."""


def check_pool_name(pool: str) -> None:
    if not POOL_NAME.fullmatch(pool):
        raise InvalidRequest(f"pool name {pool!r} must match {POOL_NAME.pattern}")


def question_id_problem(qid: str) -> str | None:
    """Why `qid` cannot name a question (in a trajectory, a question or a request), or None."""
    if not qid:
        return "missing question_id"
    if len(qid) > MAX_QUESTION_ID_CHARS:
        return f"question_id longer than {MAX_QUESTION_ID_CHARS} characters"
    return None


def check_question_id(qid: str, where: str) -> None:
    """InvalidRequest naming `where` (e.g. "question_ids[3]") when `question_id_problem` finds a problem."""
    if problem := question_id_problem(qid):
        raise InvalidRequest(f"{where}: {problem}")


def trajectory_problem(traj: trajectory_pb2.Trajectory, max_trajectory_bytes: int) -> str | None:
    """Why a trajectory cannot be stored (the reason its rejection carries), or None."""
    if problem := question_id_problem(traj.question_id):
        return problem
    if not traj.response_text:
        return "missing response_text"
    if traj.verdict not in trajectory_pb2.Verdict.values():
        return f"unknown verdict {traj.verdict}"
    if traj.verdict != trajectory_pb2.CORRECT:
        return f"not a success (verdict {trajectory_pb2.Verdict.Name(traj.verdict)}); the pool keeps CORRECT only"
    if len(traj.tokenizer_fingerprint) > MAX_FINGERPRINT_CHARS:
        return f"tokenizer_fingerprint longer than {MAX_FINGERPRINT_CHARS} characters"
    if traj.behavior_logprobs and len(traj.behavior_logprobs) != len(traj.response_token_ids):
        return "behavior_logprobs and response_token_ids differ in length"
    if problem := _trace_problem(traj):
        return problem
    sampled = traj.response_mask or [1] * len(traj.behavior_logprobs)  # a tool's tokens have no logprob (NaN)
    if not all(math.isfinite(lp) for lp, m in zip(traj.behavior_logprobs, sampled, strict=False) if m):
        return "behavior_logprobs must be finite"  # a NaN would reach the learner's IS weights
    if traj.ByteSize() > max_trajectory_bytes:
        return f"oversize: {traj.ByteSize()} bytes > {max_trajectory_bytes}"
    return None


def _trace_problem(traj: trajectory_pb2.Trajectory) -> str | None:
    """Why a tool trace's own fields do not fit together (a single-turn answer has none of them), or None."""
    if len(traj.chat_template_hash) > MAX_FINGERPRINT_CHARS or len(traj.tool_env_hash) > MAX_FINGERPRINT_CHARS:
        return f"chat_template_hash and tool_env_hash take at most {MAX_FINGERPRINT_CHARS} characters"
    if not traj.response_mask:
        return "tool_calls without a response_mask (its tool tokens would be trained on)" if traj.tool_calls else None
    if len(traj.response_mask) != len(traj.response_token_ids):
        return "response_mask and response_token_ids differ in length"
    if not set(traj.response_mask) <= {0, 1} or 1 not in traj.response_mask:
        return "response_mask holds 0 (tool) and 1 (policy) only, with at least one policy token"
    if len(traj.tool_calls) > MAX_TOOL_CALLS:
        return f"more than {MAX_TOOL_CALLS} tool_calls"
    return None


def check_add(
    pool: str,
    trajectories: Sequence[trajectory_pb2.Trajectory],
    questions: Sequence[replay_pb2.Question],
    config: ReplayConfig,
) -> None:
    """Whole-request checks of an add (AddTrajectories, or one ImportPool chunk): counts, question metadata,
    rewards. Raises InvalidRequest, and nothing of the add is stored."""
    check_pool_name(pool)
    if len(trajectories) > config.max_trajectories_per_add:
        raise InvalidRequest(f"{len(trajectories)} trajectories in one call, over {config.max_trajectories_per_add}")
    if len(questions) > config.max_trajectories_per_add:
        raise InvalidRequest(f"{len(questions)} questions in one call, over {config.max_trajectories_per_add}")
    _check_question_metadata(questions, config)
    for index, traj in enumerate(trajectories):
        # A NaN reward would be stored as a success and poison every advantage it is mixed into.
        if not math.isfinite(traj.reward):
            raise InvalidRequest(f"trajectories[{index}].reward is {traj.reward}; rewards must be finite")


def check_sample(request: replay_pb2.SampleRequest, config: ReplayConfig) -> Strategy:
    """The strategy a Sample asks for, once the request is within bounds.

    Raises InvalidRequest for a malformed request and LimitExceeded when question ids x m passes
    `max_sample_trajectories`.
    """
    check_pool_name(request.pool)
    if not 1 <= request.m <= config.max_m:
        raise InvalidRequest(f"m must be in 1..{config.max_m}, got {request.m}")
    if not request.question_ids:
        raise InvalidRequest("question_ids is empty")
    if len(request.question_ids) > config.max_questions_per_sample:
        raise InvalidRequest(f"{len(request.question_ids)} question ids, over {config.max_questions_per_sample}")
    if request.strategy not in STRATEGIES:
        raise InvalidRequest(f"unknown strategy {request.strategy}")
    for index, qid in enumerate(request.question_ids):
        check_question_id(qid, f"question_ids[{index}]")
    asked = len(request.question_ids) * request.m
    if asked > config.max_sample_trajectories:
        raise LimitExceeded(
            f"the call asks for up to {asked} trajectories (question ids x m), over the limit of "
            f"{config.max_sample_trajectories} (max_sample_trajectories); split it"
        )
    return STRATEGIES[request.strategy]


def check_reply_bytes(reply_bytes: int, max_sample_bytes: int) -> None:
    """LimitExceeded when a Sample's reply would carry more than `max_sample_bytes` of trajectories."""
    if reply_bytes > max_sample_bytes:
        raise LimitExceeded(
            f"the reply would hold {reply_bytes} bytes of trajectories, over the limit of "
            f"{max_sample_bytes} (max_sample_bytes); ask for fewer questions per call or a smaller m"
        )


def check_priority_updates(request: replay_pb2.UpdatePrioritiesRequest, config: ReplayConfig) -> None:
    check_pool_name(request.pool)
    if len(request.updates) > config.max_trajectories_per_add:
        raise InvalidRequest(f"{len(request.updates)} updates in one call, over {config.max_trajectories_per_add}")
    for update in request.updates:
        if not update.priority > 0 or not math.isfinite(update.priority):
            raise InvalidRequest(f"priority must be finite and > 0, got {update.priority} for {update.question_id!r}")
        check_question_id(update.question_id, "updates")


def check_drop(request: replay_pb2.DropPoolRequest) -> None:
    check_pool_name(request.pool)
    if request.confirm != request.pool:
        raise InvalidRequest("DropPool needs confirm equal to the pool name")


def export_chunk_questions(request: replay_pb2.ExportPoolRequest) -> int:
    """How many questions an export chunk holds at most (0 in the request: the default)."""
    check_pool_name(request.pool)
    if not 0 <= request.questions_per_chunk <= MAX_QUESTIONS_PER_CHUNK:
        raise InvalidRequest(
            f"questions_per_chunk must be in 1..{MAX_QUESTIONS_PER_CHUNK} (0: {DEFAULT_QUESTIONS_PER_CHUNK}), "
            f"got {request.questions_per_chunk}"
        )
    return request.questions_per_chunk or DEFAULT_QUESTIONS_PER_CHUNK


def import_pool_name(pool: str, chunk: replay_pb2.PoolChunk) -> str:
    """The pool an ImportPool stream writes to, given the pool named so far ("" before any) and the next chunk."""
    if pool and chunk.pool and chunk.pool != pool:
        raise InvalidRequest("every chunk of one import must name the same pool")
    return pool or chunk.pool


def check_import_named_a_pool(pool: str) -> None:
    if not pool:
        raise InvalidRequest("ImportPool needs at least one chunk naming the pool")


def _check_question_metadata(questions: Sequence[replay_pb2.Question], config: ReplayConfig) -> None:
    for index, question in enumerate(questions):
        check_question_id(question.question_id, f"questions[{index}]")
        if question.ByteSize() > config.max_question_bytes:
            raise InvalidRequest(
                f"questions[{index}] is {question.ByteSize()} bytes, over max_question_bytes "
                f"{config.max_question_bytes}"
            )


def _outcome_problem(o: replay_pb2.QuestionOutcome, max_m: int) -> str | None:
    if problem := question_id_problem(o.question_id):
        return problem
    if not 1 <= o.attempts <= MAX_ATTEMPTS:
        return f"attempts must be in 1..{MAX_ATTEMPTS}, got {o.attempts}"
    if not 0 <= o.successes <= o.attempts:
        return f"successes must be in 0..attempts ({o.attempts}), got {o.successes}"
    if not (math.isfinite(o.mean_reward) and abs(o.mean_reward) <= MAX_ABS_REWARD):
        return f"mean_reward must be finite and within +-{MAX_ABS_REWARD:g}, got {o.mean_reward}"
    if not 0 <= o.replayed <= max_m:
        return f"replayed must be in 0..{max_m} (max_m), got {o.replayed}"
    if o.rescued and (o.successes or not o.replayed):
        return "rescued needs replayed rows in a group with no fresh success (successes 0, replayed > 0)"
    return None


def check_report(request: replay_pb2.ReportOutcomesRequest, config: ReplayConfig) -> list[Outcome]:
    """A ReportOutcomes request's outcomes, once every field is within bounds; InvalidRequest otherwise (the count
    is checked first, so a report of 10^6 questions is refused before any of them is read)."""
    check_pool_name(request.pool)
    if not RUN_ID.fullmatch(request.run_id):
        raise InvalidRequest(f"run_id {request.run_id!r} must match {RUN_ID.pattern}")
    for name in ("step", "policy_version"):
        if not 0 <= getattr(request, name) <= MAX_STEP:
            raise InvalidRequest(f"{name} must be in 0..{MAX_STEP}, got {getattr(request, name)}")
    count = len(request.outcomes)
    if not 1 <= count <= config.max_outcomes_per_report:
        raise InvalidRequest(f"{count} outcomes in one report; it takes 1..{config.max_outcomes_per_report}")
    if len(request.questions) > count:
        raise InvalidRequest(f"{len(request.questions)} questions' metadata for {count} outcomes")
    _check_question_metadata(request.questions, config)
    seen: set[str] = set()
    for index, o in enumerate(request.outcomes):
        if problem := _outcome_problem(o, config.max_m):
            raise InvalidRequest(f"outcomes[{index}]: {problem}")
        if o.question_id in seen:  # it would count twice in one step
            raise InvalidRequest(f"outcomes[{index}]: question {o.question_id!r} is reported twice")
        seen.add(o.question_id)
    return [
        Outcome(o.question_id, o.attempts, o.successes, o.mean_reward, o.replayed, o.rescued) for o in request.outcomes
    ]


def check_question_stats(request: replay_pb2.GetQuestionStatsRequest, config: ReplayConfig) -> QuestionQuery:
    """The query a GetQuestionStats asks for; InvalidRequest for a malformed one."""
    check_pool_name(request.pool)
    if request.filter not in QUESTION_FILTERS:
        raise InvalidRequest(f"unknown filter {request.filter}")
    band = request.filter == replay_pb2.PASS_RATE_BAND
    if request.question_ids:
        if request.filter or request.cursor or request.limit or request.min_pass_rate or request.max_pass_rate:
            raise InvalidRequest("question_ids lists questions: filter, pass rates, cursor and limit must be unset")
        if len(request.question_ids) > config.max_outcomes_per_report:
            raise InvalidRequest(f"{len(request.question_ids)} question ids, over {config.max_outcomes_per_report}")
        for index, qid in enumerate(request.question_ids):
            check_question_id(qid, f"question_ids[{index}]")
        return QuestionQuery(question_ids=tuple(dict.fromkeys(request.question_ids)))
    low, high = request.min_pass_rate, request.max_pass_rate
    if band and not 0 <= low <= high <= 1:  # NaN fails every comparison
        raise InvalidRequest(f"PASS_RATE_BAND needs 0 <= min_pass_rate <= max_pass_rate <= 1, got [{low}, {high}]")
    if not band and (low or high):
        raise InvalidRequest("min_pass_rate and max_pass_rate apply to the PASS_RATE_BAND filter only")
    if not 0 <= request.limit <= MAX_QUESTION_PAGE:
        raise InvalidRequest(
            f"limit must be in 1..{MAX_QUESTION_PAGE} (0: {DEFAULT_QUESTION_PAGE}), got {request.limit}"
        )
    if request.cursor and not (
        (match := CURSOR.fullmatch(request.cursor)) and question_id_problem(match.group(1)) is None
    ):
        raise InvalidRequest("cursor is not a next_cursor this service returned")
    return QuestionQuery(
        filter=QUESTION_FILTERS[request.filter],
        min_pass_rate=low if band else 0.0,
        max_pass_rate=high if band else 1.0,
        limit=request.limit or DEFAULT_QUESTION_PAGE,
        cursor=request.cursor,
    )


def history_record(history: replay_pb2.QuestionHistory) -> QuestionRecord:
    """An imported history as a record; InvalidRequest when its fields cannot be a history (a damaged file)."""
    check_question_id(history.question_id, "histories")
    record = QuestionRecord(
        history.question_id,
        **{name: getattr(history, PROTO_NAMES.get(name, name)) for name in RECORD_FIELDS},
        window_attempts=tuple(history.window_attempts),
        window_successes=tuple(history.window_successes),
    )
    if problem := _record_problem(record):
        raise InvalidRequest(f"history of {history.question_id!r}: {problem}")
    return record


# QuestionHistory's names of the record's fields, where they differ.
PROTO_NAMES = {
    "ema": "ema_pass_rate",
    "first_version": "first_policy_version",
    "last_version": "last_policy_version",
}


def _record_problem(r: QuestionRecord) -> str | None:
    counts = [getattr(r, n) for n in RECORD_FIELDS if n not in FLOAT_FIELDS and n != "last_solved_step"]
    if not all(0 <= c <= MAX_STEP for c in counts) or not -1 <= r.last_solved_step <= MAX_STEP:
        return f"counts, steps and versions must be in 0..{MAX_STEP} (last_solved_step -1 for never)"
    if r.successes > r.attempts or r.visits < 1:
        return "more successes than attempts, or no visit"
    if not (math.isfinite(r.reward_sum) and 0 <= r.ema <= 1):  # NaN fails the comparison
        return "reward_sum must be finite and ema_pass_rate in [0, 1]"
    visits = len(r.window_attempts)
    if not 1 <= visits <= MAX_WINDOW or visits != len(r.window_successes):
        return f"the window must hold 1..{MAX_WINDOW} visits, as many attempts as successes"
    window = zip(r.window_attempts, r.window_successes, strict=True)  # lengths checked above
    if any(not 1 <= a <= MAX_ATTEMPTS or not 0 <= s <= a for a, s in window):
        return "a window visit with no attempt, or more successes than attempts"
    return None


def check_histories(histories: Sequence[replay_pb2.QuestionHistory], config: ReplayConfig) -> list[QuestionRecord]:
    """An import chunk's histories as records; InvalidRequest (and nothing of the chunk stored) for a bad one."""
    if len(histories) > config.max_trajectories_per_add:
        raise InvalidRequest(f"{len(histories)} histories in one chunk, over {config.max_trajectories_per_add}")
    return [history_record(h) for h in histories]
