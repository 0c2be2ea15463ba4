"""Plain data of the rollout service, shared by the engine, the server and the typed client."""

from __future__ import annotations

from dataclasses import dataclass

from rlep.common.types import FinishReason

# vLLM's own bounds on sampling (vllm/sampling_params.py): it refuses temperatures above MAX_TEMPERATURE, and
# below GREEDY_BELOW it decodes greedily and refuses n > 1. Rollout checks them before its engine sees a request;
# eval checks them at submission.
MAX_TEMPERATURE = 2.0
GREEDY_BELOW = 1e-5


def greedy_problem(n: int, temperature: float) -> str | None:
    """Why greedy sampling with n > 1 is refused, or None."""
    if temperature < GREEDY_BELOW and n > 1:
        return (
            f"greedy sampling gives n identical samples; send n=1 or temperature > 0 "
            f"(got n={n}, temperature={temperature:g}; below {GREEDY_BELOW:g} vLLM samples greedily)"
        )
    return None


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class SampleOut:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int


@dataclass
class Generation:
    """Samples per prompt, in request order; `policy_version` is shared by all of them."""

    samples: list[list[SampleOut]]
    policy_version: int
    queue_seconds: float
    engine_seconds: float
    generated_tokens: int


@dataclass
class Completion:
    """What the client returns per prompt: the prompt as tokenized by the worker, and its samples."""

    prompt_token_ids: list[int]
    samples: list[SampleOut]
