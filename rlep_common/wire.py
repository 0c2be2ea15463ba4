"""Conversion between the shared dataclasses (`rlep.common.types`) and `rlep.common.v1` messages."""

from __future__ import annotations

from rlep.common.types import FinishReason, Source, ToolCall, Trajectory, Verdict
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
    """A tool episode travels whole: its mask, its calls and its environment's hashes (`excluded_from_loss` is the
    learner's own, of one step: it does not travel)."""
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
        response_mask=t.response_mask,
        chat_template_hash=t.chat_template_hash,
        tool_env_hash=t.tool_env_hash,
        tool_calls=[tool_call_to_proto(c) for c in t.tool_calls],
    )


def tool_call_to_proto(c: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(
        code=c.code,
        status=c.status,
        exit_code=c.exit_code,
        stdout=c.stdout,
        stderr=c.stderr,
        duration_s=c.duration_s,
        truncated=c.truncated,
    )


def tool_call_from_proto(m: pb.ToolCall) -> ToolCall:
    exit_code = m.exit_code if m.HasField("exit_code") else None
    return ToolCall(m.code, m.status, exit_code, m.stdout, m.stderr, m.duration_s, m.truncated)


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
        response_mask=tuple(m.response_mask),
        chat_template_hash=m.chat_template_hash,
        tool_env_hash=m.tool_env_hash,
        tool_calls=tuple(tool_call_from_proto(c) for c in m.tool_calls),
    )
