"""Multi-turn tool episodes on the real engine and the real sandbox (issue 50): the logprobs vLLM gave every token
the policy sampled, in every turn, equal the learner's old logprobs of its batch of the episodes (its layout, tool
tokens masked, its scoring model over the same weights). Nothing was rendered again as text. Stored as traces in the
real replay service and drawn back, they replay as stored, with the same logprobs.

The tiny model writes random characters, so the markers here are one character each, `(` and `)`: of 128 episodes
about 20 make a call and go on after it (22 measured). The code between is mostly not Python, and the sandbox's
error is what the policy reads.
"""

from __future__ import annotations

import pytest
import torch

from rlep.common.types import Group, Verdict
from rlep.services.learner.batch import ScoringModel, build_batch
from rlep.services.learner.scored_trajectories import ReplayReport, TraceRules, prepare_replayed
from rlep.services.learner.tokens import EncodedPrompt, PolicyTokenizer
from rlep.services.learner.tool_rollouts import ToolLoopConfig, run_episodes, tool_output_text
from rlep.services.rollout.types import Sampling
from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.sandbox import Sandbox
from rlep.services.weights.transport import StreamTransport

pytestmark = pytest.mark.integration

# Short output markers and outputs (a traceback cut to 24 tokens): more turns fit in the engine's 512 tokens.
CONFIG = ToolLoopConfig(call_open="(", call_close=")", output_open="[", output_close="]", truncated_mark="~",
                        max_calls=3, max_output_tokens=24)  # fmt: skip


@pytest.fixture
def known_weights(rollout, rollout_client):
    """The engine loaded with the tiny model's own weights under a new version (other tests push others), and the
    same model in transformers (float32 both)."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(rollout.engine.model_path, dtype=torch.float32).eval()
    state = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    version = rollout.engine.version + 1
    [reply] = rollout_client.push_weights(state, version, transport=StreamTransport())
    assert reply.version == version
    return model, version


def test_tool_episodes_are_token_exact_on_the_engine_and_the_sandbox_runs_each_call(
    rollout, rollout_client, known_weights, replay_client, pool_name
):
    model, version = known_weights
    tokenizer = rollout.engine.tokenizer
    prompts = [tokenizer.encode(q, add_special_tokens=False) for q in ("Q: 7*8=?\nA: ", "Q: 9+4=?\nA: ")]
    sandbox = Sandbox(SandboxConfig(cpu_seconds=2, wall_seconds=5))
    sampling = Sampling(n=64, temperature=1.0, max_tokens=320, seed=5)
    groups = run_episodes(prompts, sampling, rollout_client.generate, sandbox.run, tokenizer, CONFIG)
    episodes = [e for group in groups for e in group]
    assert [len(group) for group in groups] == [64, 64] and all(e.prompt_token_ids == prompts[1] for e in groups[1])

    went_on = [e for e in episodes if e.calls and e.segments[-1].source == "policy"]
    assert len(went_on) >= 3, [(e.finish, len(e.calls)) for e in episodes]
    assert {e.finish for e in episodes} <= {"answer", "length", "call_limit", "void"}
    for episode in episodes:
        assert len(episode.response_token_ids) <= sampling.max_tokens
        assert episode.policy_versions == [version]
        tools = [s for s in episode.segments if s.source == "tool"]
        assert len(tools) == len(episode.calls) <= CONFIG.max_calls
        for segment, call in zip(tools, episode.calls, strict=True):
            # The sandbox ran it, and its answer is what the policy read (cut where too long).
            assert call.status in ("ok", "error") and call.duration_s > 0
            shown = tokenizer.decode(list(segment.token_ids))
            assert shown.startswith(CONFIG.output_open + tool_output_text_from(call)[:8])
    assert any("Error" in call.stderr for e in episodes for call in e.calls)  # mostly not Python

    # The learner's view: its batch of the episodes (tool tokens masked) and its scoring of every position.
    group = Group("q", "56", [e.to_trajectory("q", "", 0.0) for e in episodes])
    batch = build_batch([group], pad_id=tokenizer.pad_token_id, with_behavior=True)
    with torch.no_grad():
        old, _ = ScoringModel(model)(batch.tokens, batch.attention_mask, with_entropy=False)
    policy = batch.loss_mask == 1
    assert policy.sum() == sum(sum(e.loss_mask) for e in episodes) < batch.attention_mask[:, 1:].sum()
    assert torch.isfinite(batch.behavior_logprobs[policy]).all()
    worst = (old[policy] - batch.behavior_logprobs[policy]).abs().max().item()
    assert worst < 1e-4, f"max |learner - vLLM| logprob difference over policy tokens {worst}"

    # Part 3: the episodes that called, stored as traces in the real replay service and drawn back by the learner
    # (`prepare_replayed`): trained on their stored ids, tool tokens masked, their old logprobs the engine's.
    learner = PolicyTokenizer.load(rollout.engine.model_path, max_prompt_tokens=64, max_response_tokens=320)
    env = {"tokenizer_fingerprint": learner.fingerprint, "chat_template_hash": "c", "tool_env_hash": "e"}
    called = {f"q{g}": [e for e in group if e.calls][:4] for g, group in enumerate(groups)}  # the pool keeps 8
    traces = [
        e.to_trajectory(qid, f"trace {i}", 1.0, verdict=Verdict.CORRECT, **env)
        for qid, some in called.items()
        for i, e in enumerate(some)
    ]
    assert replay_client.add(pool_name, traces).added == len(traces) >= 3
    drawn = replay_client.sample(pool_name, list(called), m=4, seed=0)
    report = ReplayReport()
    rules = TraceRules("c", "e", run_id="this run", policy_version=version)
    asked = {qid: EncodedPrompt(tuple(p)) for qid, p in zip(called, prompts, strict=True)}
    replayed = [t for rows in prepare_replayed(drawn, asked, learner, report, rules).values() for t in rows]
    assert len(replayed) == len(traces) and not report.dropped and report.retokenized == 0
    stored = {(t.question_id, t.response_text): t for t in traces}
    for row in replayed:
        assert row.response_token_ids == stored[row.question_id, row.response_text].response_token_ids
        assert row.response_mask == stored[row.question_id, row.response_text].response_mask
    replay_batch = build_batch([Group("q", "56", replayed)], pad_id=tokenizer.pad_token_id)  # one group: rows in order
    with torch.no_grad():
        replay_old, _ = ScoringModel(model)(replay_batch.tokens, replay_batch.attention_mask, with_entropy=False)
    for i, row in enumerate(replayed):
        mask = torch.tensor(row.response_mask, dtype=torch.bool)
        start = len(row.prompt_token_ids) - 1
        positions = torch.arange(start, start + len(mask))
        assert (
            replay_batch.loss_mask[i, positions[~mask]].eq(0).all()
            and replay_batch.loss_mask[i, positions[mask]].eq(1).all()
        )
        engine = torch.tensor(stored[row.question_id, row.response_text].behavior_logprobs)[mask]
        assert (replay_old[i, positions[mask]] - engine).abs().max().item() < 1e-4


def tool_output_text_from(call) -> str:
    from rlep.services.sandbox.types import ToolResult

    return tool_output_text(ToolResult(call.status, call.exit_code, None, call.stdout, call.stderr, call.truncated,
                                       call.duration_s, "bubblewrap"))  # fmt: skip
