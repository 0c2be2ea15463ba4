"""Plain data of the rollout service, shared by the engine, the server and the typed client."""

from __future__ import annotations

import hashlib
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


def prompt_seed(seed: int, index: int) -> int:
    """The seed vLLM gets for the `index`-th prompt of a request seeded with `seed`.

    vLLM seeds each request's sampler with its own `seed` (and child i of an n > 1 request with seed + i), so a
    seed shared by every prompt of a batch gives them all the same random numbers: their samples are correlated
    (identical prompts get identical samples), and an accuracy over Q prompts varies far more than
    sqrt(p(1-p)/Q). A hash of (seed, index) gives each prompt its own stream, still reproducible from the seed;
    62 bits leave room for vLLM's seed + i.
    """
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def shard_seed(seed: int | None, start: int) -> int | None:
    """The seed of the shard of a seeded call that starts at prompt `start` (the client splits a call over replicas
    and calls): the whole call's seed for the first, a distinct one for each other, so that prompt i of one shard
    does not share prompt i of another's stream. (A negative index is a name prompt_seed never gives a prompt.)"""
    return seed if seed is None or start == 0 else prompt_seed(seed, -start)


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
