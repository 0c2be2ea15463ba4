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
from rlep.services.replay.sampling import Strategy

# Matched whole (`fullmatch`): `$` alone lets a trailing newline through ("base\n" would be a pool of its own).
POOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_QUESTION_ID_CHARS = 256
MAX_FINGERPRINT_CHARS = 64
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
    if not all(map(math.isfinite, traj.behavior_logprobs)):  # a NaN would reach the learner's IS weights
        return "behavior_logprobs must be finite"
    if traj.ByteSize() > max_trajectory_bytes:
        return f"oversize: {traj.ByteSize()} bytes > {max_trajectory_bytes}"
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
    for index, question in enumerate(questions):
        check_question_id(question.question_id, f"questions[{index}]")
        if question.ByteSize() > config.max_question_bytes:
            raise InvalidRequest(
                f"questions[{index}] is {question.ByteSize()} bytes, over max_question_bytes "
                f"{config.max_question_bytes}"
            )
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
