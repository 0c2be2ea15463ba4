"""Checks of a Generate request's sampling options, done in the RPC thread before the engine sees them.

vLLM validates `SamplingParams` when it builds them and raises on values it refuses (temperature
above 2, greedy sampling with n > 1, ...). Built on the engine thread, such a request would kill
that thread and wedge the replica, so vLLM's limits on these options are checked here first, with a
message naming the field and the limit; `RolloutEngine.submit` then builds the `SamplingParams`
in the caller's thread as well, so anything vLLM refuses on top of this is still the caller's
INVALID_ARGUMENT, never the engine's problem.
"""

from __future__ import annotations

import math

from rlep.rollout.v1 import rollout_pb2
from rlep.services.rollout.config import RolloutConfig
from rlep.services.rollout.types import GREEDY_BELOW, MAX_TEMPERATURE, Sampling

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


def greedy_problem(n: int, temperature: float) -> str | None:
    """Why greedy sampling with n > 1 is refused, or None."""
    if temperature < GREEDY_BELOW and n > 1:
        return (
            f"greedy sampling gives n identical samples; send n=1 or temperature > 0 "
            f"(got n={n}, temperature={temperature:g}; below {GREEDY_BELOW:g} vLLM samples greedily)"
        )
    return None


def sampling_from_request(request: rollout_pb2.GenerateRequest, config: RolloutConfig) -> Sampling:
    """The request's `Sampling`, or ValueError naming the field and its limit."""
    s = request.sampling
    count = len(request.prompts)
    if count == 0:
        raise ValueError("no prompts")
    if count > config.max_prompts_per_request:
        raise ValueError(f"{count} prompts, over the limit of {config.max_prompts_per_request}; split the request")
    if not 1 <= s.n <= config.max_n:
        raise ValueError(f"sampling.n must be in [1, {config.max_n}], got {s.n}")
    if count * s.n > config.max_samples_per_request:
        raise ValueError(
            f"{count} prompts x n={s.n} samples, over the limit of {config.max_samples_per_request}; split it"
        )
    if not (math.isfinite(s.temperature) and 0 <= s.temperature <= MAX_TEMPERATURE):
        raise ValueError(f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {s.temperature}")
    if problem := greedy_problem(s.n, s.temperature):
        raise ValueError(problem)
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise ValueError(f"sampling.top_p must be in (0, 1] (0 = 1.0), got {s.top_p}")
    if s.top_k < 0:
        raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {s.top_k}")
    if s.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
    if len(s.stop) > MAX_STOP_STRINGS or any(not 0 < len(stop) <= MAX_STOP_CHARS for stop in s.stop):
        raise ValueError(
            f"sampling.stop takes at most {MAX_STOP_STRINGS} non-empty strings of up to {MAX_STOP_CHARS} characters"
        )
    return Sampling(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        stop=tuple(s.stop),
        seed=s.seed if s.HasField("seed") else None,
    )
