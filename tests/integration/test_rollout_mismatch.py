"""The train/inference mismatch a step records, measured on real replicas (issue 33): the same weights served by a
bfloat16 vLLM replica and by a float32 one, against the learner's float32 logprobs (transformers) of the tokens
each replica sampled. vLLM's `dtype: auto` runs a float32 checkpoint in bfloat16, so the first is what a default
deployment trains on."""

from __future__ import annotations

import pytest
import torch

from rlep.common.config import ServerConfig
from rlep.common.tiny_model import cached_model
from rlep.services.learner.mismatch import rollout_mismatch
from rlep.services.rollout.client import RolloutClient
from rlep.services.rollout.types import Sampling

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = ["Q: 12+30=?\nA: ", "Q: 7+8=?\nA: ", "Q: 3*4+1=?\nA: ", "Q: 99-9=?\nA: "]


def sampled_mismatch(model_dir, dtype: str):
    """Samples from a replica serving `model_dir` in `dtype`; the mismatch of its logprobs to transformers' float32."""
    from transformers import AutoModelForCausalLM

    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.main import start_rollout

    engine = {"model": str(model_dir), "dtype": dtype, "max_model_len": 256, "enforce_eager": True}
    running = start_rollout(RolloutConfig(server=ServerConfig(port=0), engine=engine))
    try:
        client = RolloutClient([f"127.0.0.1:{running.port}"], timeout_s=300)
        [status] = client.status()
        assert status.dtype == dtype
        completions = client.generate(PROMPTS, Sampling(n=8, temperature=1.0, max_tokens=24, seed=3))
        client.close()
    finally:
        running.stop()
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    old, sampler = [], []
    for completion in completions:
        prompt = completion.prompt_token_ids
        for sample in completion.samples:
            with torch.no_grad():
                logits = learner(torch.tensor([prompt + sample.token_ids])).logits[0].float()
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(sample.token_ids) - 1)
            old.append(torch.log_softmax(logits, dim=-1)[positions, torch.tensor(sample.token_ids)])
            sampler.append(torch.tensor(sample.logprobs))
    old_row, sampler_row = torch.cat(old)[None], torch.cat(sampler)[None]
    return rollout_mismatch(old_row, sampler_row, torch.ones_like(old_row), cap=2.0)


def test_a_bfloat16_replica_shows_a_mismatch_far_above_a_float32_replicas():
    model_dir = cached_model("tiny")
    as_float32 = sampled_mismatch(model_dir, "float32")
    as_bfloat16 = sampled_mismatch(model_dir, "bfloat16")
    print(f"\nmismatch, tiny model: float32 replica {as_float32}; bfloat16 replica {as_bfloat16}")
    assert as_float32.tokens > 100 and as_bfloat16.tokens > 100
    assert as_float32.kl < 1e-6  # the kernels differ, the numbers barely do
    assert as_bfloat16.kl > 100 * max(as_float32.kl, 1e-12) and as_bfloat16.kl > 1e-6
    assert as_bfloat16.ratio_max > as_float32.ratio_max
