"""Sampling checks of a Generate request (services/rollout/requests.py), and that vLLM accepts whatever they pass."""

from __future__ import annotations

import itertools

import pytest

from rlep.rollout.v1 import rollout_pb2
from rlep.services.rollout.config import RolloutConfig
from rlep.services.rollout.requests import sampling_from_request

CONFIG = RolloutConfig(max_n=8, max_prompts_per_request=4, max_samples_per_request=16)


def request(prompts: int = 1, **sampling) -> rollout_pb2.GenerateRequest:
    options = {"n": 1, "max_tokens": 8, **sampling}
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(text="q")] * prompts, sampling=rollout_pb2.SamplingOptions(**options)
    )


@pytest.mark.parametrize(
    ("prompts", "sampling", "message"),
    [
        (0, {}, "no prompts"),
        (5, {}, "over the limit of 4"),
        (1, {"n": 9}, "sampling.n must be in [1, 8]"),
        (4, {"n": 5}, "over the limit of 16"),
        (1, {"temperature": 2.5}, "sampling.temperature must be in [0, 2]"),
        (1, {"temperature": float("nan")}, "sampling.temperature"),
        (1, {"n": 2, "temperature": 0.0}, "greedy sampling gives n identical samples; send n=1 or temperature > 0"),
        (1, {"n": 2, "temperature": 1e-6}, "greedy sampling gives n identical samples"),
        (1, {"top_p": 1.5}, "sampling.top_p"),
        (1, {"top_k": -2}, "sampling.top_k"),
        (1, {"max_tokens": 0}, "sampling.max_tokens"),
        (1, {"stop": [""]}, "sampling.stop"),
        (1, {"stop": ["x" * 1025]}, "up to 1024 characters"),
    ],
)
def test_bad_sampling_is_refused_with_the_limit_named(prompts, sampling, message):
    with pytest.raises(ValueError) as info:
        sampling_from_request(request(prompts, **sampling), CONFIG)
    assert message in str(info.value)


def test_greedy_with_one_sample_and_unset_top_p_are_fine():
    greedy = sampling_from_request(request(temperature=0.0), CONFIG)
    assert greedy.n == 1 and greedy.temperature == 0.0 and greedy.top_p == 1.0
    seeded = sampling_from_request(request(n=2, temperature=0.7, seed=-5), CONFIG)
    assert seeded.seed == -5 and seeded.n == 2


def test_vllm_accepts_every_sampling_these_checks_pass():
    """Edge values on every field: whatever passes our checks builds vLLM SamplingParams without error, so no
    request that reaches the engine can fail there on its sampling options."""
    from rlep.services.rollout.vllm_args import sampling_params

    grid = itertools.product(
        [1, 2, 8],  # n
        [0.0, 1e-5, 0.5, 2.0, 5.0],  # temperature
        [0.0, 1e-3, 1.0],  # top_p
        [0, 1, 1 << 30],  # top_k
        [1, 1 << 30],  # max_tokens
        [None, -(2**63), 2**63 - 1],  # seed
    )
    checked = 0
    for n, temperature, top_p, top_k, max_tokens, seed in grid:
        options = {"n": n, "temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens}
        try:
            sampling = sampling_from_request(request(**options, seed=seed, stop=["\n\n"]), CONFIG)
        except ValueError:
            continue
        sampling_params(sampling)
        checked += 1
    assert checked > 300
