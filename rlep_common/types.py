"""The data model every service shares: trajectories and the mixed groups the learner trains on.

These dataclasses are the in-process twin of `rlep.common.v1.Trajectory` (see `rlep.common.wire`
for the conversion). A trajectory is one response to one question; a group is all trajectories of
one question in one training step, fresh and replayed together (RLEP's "mixed group").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum


class Verdict(StrEnum):
    """Outcome of checking a response against the gold answer (mirrors the proto enum)."""

    CORRECT = "correct"
    WRONG = "wrong"
    UNPARSEABLE = "unparseable"
    TIMEOUT = "timeout"
    GOLD_UNPARSEABLE = "gold_unparseable"
    ERROR = "error"


class Source(StrEnum):
    FRESH = "fresh"
    REPLAY = "replay"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


def trajectory_id(question_id: str, response_text: str) -> str:
    """Content hash that identifies a trajectory: the same answer to the same question is one item."""
    digest = hashlib.sha256()
    digest.update(question_id.encode("utf-8"))
    digest.update(b"\0")
    digest.update(response_text.encode("utf-8"))
    return digest.hexdigest()


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool episode (issue 50), as the sandbox answered it."""

    code: str
    status: str
    """The sandbox's `Status` ("ok", "error", "timeout", ...)."""
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    truncated: bool
    """The sandbox cut the output, or the loop cut it to its token budget."""


@dataclass(frozen=True)
class Trajectory:
    """One sampled response. Token ids and `behavior_logprobs` share one length when both are set."""

    question_id: str
    response_text: str
    reward: float
    source: Source = Source.FRESH
    verdict: Verdict | None = None
    policy_version: int = 0
    finish_reason: FinishReason = FinishReason.STOP
    prompt_token_ids: tuple[int, ...] = ()
    response_token_ids: tuple[int, ...] = ()
    behavior_logprobs: tuple[float, ...] = ()
    prompt_text: str = ""
    run_id: str = ""
    created_at_ms: int = 0
    tokenizer_fingerprint: str = ""
    """Which tokenizer made the token ids (`rlep.services.learner.tokens.tokenizer_fingerprint`); "" = unknown."""
    response_mask: tuple[int, ...] = ()
    """Per response token of a tool episode: 1 where the policy sampled it, 0 where a tool wrote it (never trained
    on, never in an importance ratio); empty = every response token was sampled (a single-turn answer)."""
    chat_template_hash: str = ""
    tool_env_hash: str = ""
    """A tool trace's environment (`rlep.services.learner.tool_rollouts.trace_environment`): the chat template that
    rendered its prompt and the tool loop and sandbox that answered its calls; replay skips a trace whose hashes
    differ from the learner's."""
    tool_calls: tuple[ToolCall, ...] = ()
    excluded_from_loss: bool = False
    """A tool episode left out of the update (a void turn under `tools.void_turns: filter`, SimpleTIR's rule): its
    reward still counts in its group's advantages, but none of its tokens enters the loss, the token-mean
    normaliser or an importance ratio."""

    def __post_init__(self) -> None:
        if not self.question_id:
            raise ValueError("question_id must be non-empty")
        if self.response_mask:
            if len(self.response_mask) != len(self.response_token_ids):
                raise ValueError(
                    f"response_mask ({len(self.response_mask)}) and response_token_ids "
                    f"({len(self.response_token_ids)}) must have the same length"
                )
            if not set(self.response_mask) <= {0, 1} or 1 not in self.response_mask:
                raise ValueError("response_mask holds 0 (tool) and 1 (policy) only, with at least one policy token")
        if self.excluded_from_loss and not self.response_mask:
            raise ValueError("excluded_from_loss is for tool episodes (response_mask set)")
        if self.behavior_logprobs and len(self.behavior_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"behavior_logprobs ({len(self.behavior_logprobs)}) and response_token_ids "
                f"({len(self.response_token_ids)}) must have the same length"
            )

    @property
    def id(self) -> str:
        return trajectory_id(self.question_id, self.response_text)

    @property
    def is_success(self) -> bool:
        return self.verdict == Verdict.CORRECT


@dataclass
class Group:
    """All trajectories of one question in one step: G fresh plus M replayed ones."""

    question_id: str
    ground_truth: str
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def num_replayed(self) -> int:
        return sum(t.source == Source.REPLAY for t in self.trajectories)
