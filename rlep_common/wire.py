"""Conversion between the shared dataclasses (`rlep.common.types`) and `rlep.common.v1` messages."""

from __future__ import annotations

from rlep.common.types import FinishReason, Source, Trajectory, Verdict
from rlep.common.v1 import trajectory_pb2 as pb

VERDICT_TO_PROTO: dict[Verdict, int] = {
    Verdict.CORRECT: pb.CORRECT,
    Verdict.WRONG: pb.WRONG,
    Verdict.UNPARSEABLE: pb.UNPARSEABLE,
    Verdict.TIMEOUT: pb.TIMEOUT,
    Verdict.GOLD_UNPARSEABLE: pb.GOLD_UNPARSEABLE,
    Verdict.ERROR: pb.ERROR,
}
VERDICT_FROM_PROTO: dict[int, Verdict] = {v: k for k, v in VERDICT_TO_PROTO.items()}
SOURCE_TO_PROTO: dict[Source, int] = {Source.FRESH: pb.FRESH, Source.REPLAY: pb.REPLAY}
SOURCE_FROM_PROTO: dict[int, Source] = {v: k for k, v in SOURCE_TO_PROTO.items()}
FINISH_TO_PROTO: dict[FinishReason, int] = {
    FinishReason.STOP: pb.STOP,
    FinishReason.LENGTH: pb.LENGTH,
    FinishReason.ABORT: pb.ABORT,
}
FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in FINISH_TO_PROTO.items()}


def trajectory_to_proto(t: Trajectory) -> pb.Trajectory:
    """Raises ValueError for a tool episode (`response_mask`): the contract cannot carry its mask yet, and a trace
    sent without it would be trained on its tool outputs."""
    if t.response_mask:
        raise ValueError(
            f"trajectory of question {t.question_id!r} is a tool episode (response_mask set): the v1 Trajectory "
            "message does not carry tool traces yet (issue 50, replay of tool traces)"
        )
    return pb.Trajectory(
        question_id=t.question_id,
        prompt_token_ids=t.prompt_token_ids,
        response_token_ids=t.response_token_ids,
        response_text=t.response_text,
        reward=t.reward,
        verdict=VERDICT_TO_PROTO[t.verdict] if t.verdict is not None else pb.VERDICT_UNSPECIFIED,
        source=SOURCE_TO_PROTO[t.source],
        policy_version=t.policy_version,
        finish_reason=FINISH_TO_PROTO[t.finish_reason],
        behavior_logprobs=t.behavior_logprobs,
        run_id=t.run_id,
        prompt_text=t.prompt_text,
        created_at_ms=t.created_at_ms,
        tokenizer_fingerprint=t.tokenizer_fingerprint,
    )


def trajectory_from_proto(m: pb.Trajectory) -> Trajectory:
    """Raises ValueError on a message that does not describe a valid trajectory."""
    return Trajectory(
        question_id=m.question_id,
        response_text=m.response_text,
        reward=m.reward,
        source=SOURCE_FROM_PROTO.get(m.source, Source.FRESH),
        verdict=VERDICT_FROM_PROTO.get(m.verdict),
        policy_version=m.policy_version,
        finish_reason=FINISH_FROM_PROTO.get(m.finish_reason, FinishReason.STOP),
        prompt_token_ids=tuple(m.prompt_token_ids),
        response_token_ids=tuple(m.response_token_ids),
        behavior_logprobs=tuple(m.behavior_logprobs),
        prompt_text=m.prompt_text,
        run_id=m.run_id,
        created_at_ms=m.created_at_ms,
        tokenizer_fingerprint=m.tokenizer_fingerprint,
    )
