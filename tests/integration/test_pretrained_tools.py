"""Tool episodes on a pretrained chat model (issue 50): SmolLM2-135M-Instruct, its chat template's tool turns and the
function-call format chat models are taught (`<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>`),
on the real vLLM engine (float32, as the learner) and the real sandbox.

Token in, token out across the turn boundary the template draws: the tool's output sits in a `tool` turn rendered by
the template (`<|im_end|>`, `<|im_start|>tool`, ..., `<|im_start|>assistant` as their special ids), and on every
token the policy sampled, in every turn, the learner's old logprob equals vLLM's. The conversation holds two worked
exchanges before the question (a 135M model rarely calls a tool from an instruction alone).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rlep.common.config import ServerConfig
from rlep.common.types import Group
from rlep.services.learner.batch import ScoringModel, build_batch
from rlep.services.learner.tool_rollouts import ToolLoopConfig, run_episodes, template_markers
from rlep.services.rollout.types import Sampling
from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.sandbox import Sandbox

# Alone: 48 s to start the engine, 87 s and 179 s for the two tests (2 cores, 2026-11-29); beside a second xdist
# worker's vLLM engines the machine ran at a load of 9-15, where 600 s is too close a bound for a hang guard.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

LOOP = ToolLoopConfig(call_open="<tool_call>", call_close="</tool_call>", call_format="json",
                      output_markers="chat_template", max_calls=2, max_output_tokens=64)  # fmt: skip
SYSTEM = (
    'You can run Python. To run code, write <tool_call>{"name": "python", "arguments": {"code": "..."}}'
    "</tool_call> and read its output; then give the final answer as \\boxed{}."
)


def exchange(question: str, code: str, printed: str) -> list[dict[str, str]]:
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": printed},
        {"role": "assistant", "content": f"\\boxed{{{printed.strip()}}}"},
    ]


# Two worked exchanges before the question: with them SmolLM2 closed a call in 16 of 32 samples at T=1 (1 with
# one). Most of its calls are not valid JSON: each is answered with why, in a tool turn, and the episode goes on.
EXAMPLE = [*exchange("What is 2*3+4?", "print(2*3+4)", "10\n"), *exchange("What is 15+27+8?", "print(15+27+8)", "50\n")]


@pytest.fixture(scope="module")
def smollm2_float32(smollm2_dir, auth_token_file):
    """SmolLM2 behind a real rollout server in float32 (vLLM's `auto` is bfloat16 on CPU: a gap that is not drift)."""
    from rlep.services.rollout.client import RolloutClient
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.main import start_rollout

    engine = {"model": str(smollm2_dir), "dtype": "float32", "max_model_len": 1024, "max_num_seqs": 16,
              "enforce_eager": True}  # fmt: skip
    config = RolloutConfig(server=ServerConfig(port=0, metrics_port=0, auth_token_file=auth_token_file), engine=engine)
    running = start_rollout(config)
    address = f"127.0.0.1:{running.port}"
    client = RolloutClient([address], token=auth_token_file.read_text().strip(), timeout_s=300)
    yield SimpleNamespace(address=address, client=client)
    client.close()
    running.stop()


def test_smollm2_tool_episodes_are_token_exact_across_its_template_turns(smollm2_dir, smollm2_float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    opened, closed = template_markers(tokenizer)
    assert (opened, closed) == ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    end, start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    questions = ["What is 37*41+12?", "What is the sum of 123, 456 and 789?"]
    prompts = []
    for question in questions:
        messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    sandbox = Sandbox(SandboxConfig(cpu_seconds=2, wall_seconds=10))
    sampling = Sampling(n=12, temperature=1.0, max_tokens=112, seed=3)
    groups = run_episodes(prompts, sampling, smollm2_float32.client.generate, sandbox.run, tokenizer, LOOP)
    episodes = [e for group in groups for e in group]

    calls = [c for e in episodes for c in e.calls]
    went_on = [e for e in episodes if e.calls and e.segments[-1].source == "policy"]
    assert len(calls) >= 4 and len(went_on) >= 4, [(e.finish, [c.status for c in e.calls]) for e in episodes]
    for episode in went_on:
        tool = list(next(s for s in episode.segments if s.source == "tool").token_ids)
        # The template's turn: its special tokens as the special ids (a drift bug writes them as characters).
        assert tool[0] == end and start in tool and tool[-len(tokenizer.encode(closed)) :] == tokenizer.encode(closed)

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    group = Group("q", "1529", [e.to_trajectory("q", "", 0.0) for e in episodes])
    batch = build_batch([group], pad_id=tokenizer.pad_token_id or 0, with_behavior=True)
    with torch.no_grad():
        old, _ = ScoringModel(model)(batch.tokens, batch.attention_mask, with_entropy=False)
    policy = batch.loss_mask == 1
    assert policy.sum() == sum(sum(e.loss_mask) for e in episodes) < batch.attention_mask[:, 1:].sum()
    worst = (old[policy] - batch.behavior_logprobs[policy]).abs().max().item()
    # Later turns alone: the tokens the policy wrote after reading a tool output (where drift would show).
    later = torch.zeros_like(policy)
    for row, episode in enumerate(episodes):
        offset = len(episode.prompt_token_ids) - 1
        after = [k for k, s in enumerate(episode.segments) if s.source == "tool"]
        if after:
            first_later = sum(len(s.token_ids) for s in episode.segments[: after[0] + 1])
            later[row, offset + first_later : offset + len(episode.response_token_ids)] = True
    later &= policy
    assert later.sum() >= 10
    later_worst = (old[later] - batch.behavior_logprobs[later]).abs().max().item()
    invalid = sum(c.status == "refused" for c in calls)
    print(f"\nSmolLM2 float32 tool episodes: {len(calls)} calls ({invalid} not valid), {len(went_on)} went on; max "
          f"|learner - vLLM| logprob {worst:.2e} over {int(policy.sum())} policy tokens, {later_worst:.2e} after a "
          "tool turn")  # fmt: skip
    assert worst < 1e-3 and later_worst < 1e-3


def test_rlep_train_with_tools_on_smollm2_for_two_steps(
    ray_local, smollm2_dir, smollm2_float32, verifier, auth_token_file, tmp_path
):
    """`rlep train` with the chat template's tool turns: two steps of tool episodes on the float32 engine, trained
    with the tool's tokens masked; the learner's old logprobs match the engine's on the policy's tokens. The prompts
    hold the two worked exchanges and no instruction: on one CPU thread the learner's update costs ~1 s per 30
    tokens of this 135M model (8 episodes with the instruction took 85 s a step)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from rlep.services.cli.app import app
    from rlep.services.learner.records import StepRecord, read_step_log

    rows = [
        {"data_source": "rlep-arith", "ability": "arithmetic", "extra_info": {"index": i},
         "prompt": [*EXAMPLE, {"role": "user", "content": f"What is {question}?"}],
         "reward_model": {"ground_truth": truth, "style": "rule"}}
        for i, (question, truth) in enumerate([("37*41+12", "1529"), ("123+456+789", "1368")])
    ]  # fmt: skip
    data = tmp_path / "questions.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    address = smollm2_float32.address
    sets = {
        "algorithm.questions_per_step": 2, "algorithm.fresh_per_question": 2, "algorithm.replayed_per_question": 0,
        "algorithm.max_response_tokens": 96, "algorithm.overlong_buffer_tokens": 16,
        "algorithm.mini_batch_questions": 2, "optim.lr": 1e-5,
        "optim.warmup_steps": 0, "optim.micro_batch_size": 8, "deepspeed.zero_stage": 2,
        "data.train_files": json.dumps([str(data)]), "data.shuffle": False,
        "checkpoint.dir": str(tmp_path / "ckpt"),
        "endpoints.rollout": json.dumps([address]), "endpoints.verifier": f"127.0.0.1:{verifier.port}",
        "endpoints.auth_token_file": str(auth_token_file), "local.learner_cpus": 1.0,
        "tools.loop.call_open": "<tool_call>", "tools.loop.call_close": "</tool_call>",
        "tools.loop.call_format": "json", "tools.loop.output_markers": "chat_template",
        "tools.loop.max_calls": 2, "tools.loop.max_output_tokens": 48,
    }  # fmt: skip
    flags = [a for key, value in sets.items() for a in ("--set", f"{key}={value}")]
    result = CliRunner().invoke(app, ["train", "--model", str(smollm2_dir), "--steps", "2", *flags],
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    records = [r for r in read_step_log(tmp_path / "ckpt" / "log.jsonl") if isinstance(r, StepRecord)]
    assert [r.step for r in records] == [1, 2]
    for r in records:
        assert sum(r.tool_finishes.values()) == 4 and r.tool_void_turns == "filter"
        assert r.rollout_mismatch_kl is not None and abs(r.rollout_mismatch_kl) < 1e-6, r.rollout_mismatch_kl
    print(
        f"\nSmolLM2 rlep train with tools: {[r.tool_finishes for r in records]}, calls per episode "
        f"{[r.tool_calls_mean for r in records]}, mismatch KL {[r.rollout_mismatch_kl for r in records]}, "
        f"steps {[round(r.step_seconds, 1) for r in records]} s"
    )
