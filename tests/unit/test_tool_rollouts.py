"""The tool loop's logic (issue 50) against a scripted engine: turns, calls, masks, budgets, cut outputs, void turns.
The engine here stands for vLLM in the one way that matters to the loop: a stop string's tokens are in the ids it
returns. The real engine and sandbox are in tests/integration/test_tool_rollouts.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlep.common.types import FinishReason, Trajectory
from rlep.services.learner.tool_rollouts import ToolLoopConfig, run_episodes, tool_output_text
from rlep.services.rollout.types import Completion, SampleOut, Sampling
from rlep.services.sandbox.types import ToolResult


class Chars:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids) -> str:
        return "".join(chr(t) for t in token_ids)


CHARS = Chars()
PROMPT = "Q: 6*7?\nA: "


class ScriptedEngine:
    """Answers each episode's turns from `turns` in order (a turn is known by the output markers in its prompt);
    stops after a stop string or at max_tokens, as vLLM does: the stop string's tokens are in the ids, not the text."""

    def __init__(self, turns: list[str], close: str = "\n</output>\n"):
        self.turns, self.close, self.calls = turns, close, []

    def __call__(self, prompts, sampling: Sampling) -> list[Completion]:
        self.calls.append(([CHARS.decode(p) for p in prompts], sampling))
        out = []
        for prompt in prompts:
            text = self.turns[CHARS.decode(prompt).count(self.close)]
            finish = FinishReason.STOP
            ends = [text.find(s) + len(s) for s in sampling.stop if s in text]
            if ends:
                text = text[: min(ends)]
            if len(text) > sampling.max_tokens:
                text, finish = text[: sampling.max_tokens], FinishReason.LENGTH
            ids = CHARS.encode(text)
            shown = text[: text.find(sampling.stop[-1])] if sampling.stop[-1] in text else text  # vLLM drops it
            out.append(Completion(list(prompt), [SampleOut(ids, shown, [-0.5] * len(ids), finish, 3)] * sampling.n))
        return out


def ran(stdout: str = "42\n", status: str = "ok", stderr: str = "", detail: str = "", truncated: bool = False):
    calls = []

    def run_code(code: str, caller: str) -> ToolResult:
        calls.append((code, caller))
        return ToolResult(
            status, 0 if status == "ok" else 1, None, stdout, stderr, truncated, 0.01, "bubblewrap", detail
        )

    return run_code, calls


def episodes(turns, run_code, n: int = 1, budget: int = 200, **config):
    engine = ScriptedEngine(turns)
    out = run_episodes([CHARS.encode(PROMPT)], Sampling(n=n, max_tokens=budget), engine, run_code, CHARS,
                       ToolLoopConfig(**config))  # fmt: skip
    return out[0], engine


def test_a_call_runs_its_code_and_the_policy_goes_on_from_the_exact_tokens():
    run_code, calls = ran()
    [episode], engine = episodes(["Let me see <code>print(6*7)</code> (ignored)", " so \\boxed{42}"], run_code)
    assert calls == [("print(6*7)", "episode-0")]
    policy_1, tool = "Let me see <code>print(6*7)</code>", "<output>\n42\n\n</output>\n"
    assert CHARS.decode(episode.response_token_ids) == policy_1 + tool + " so \\boxed{42}"
    assert episode.loss_mask == [1] * len(policy_1) + [0] * len(tool) + [1] * len(" so \\boxed{42}")
    logprobs = episode.behavior_logprobs
    assert all(math.isnan(lp) for lp in logprobs[len(policy_1) : len(policy_1) + len(tool)])
    assert all(lp == -0.5 for i, lp in enumerate(logprobs) if episode.loss_mask[i])
    assert episode.finish == "answer" and episode.policy_versions == [3]
    [call] = episode.calls
    assert (call.code, call.status, call.stdout, call.truncated) == ("print(6*7)", "ok", "42\n", False)
    # The second turn is asked as token ids: the prompt and every token so far, nothing rendered again.
    [(first_prompts, first), (second_prompts, second)] = engine.calls
    assert first.stop == ("</code>",) and first_prompts == [PROMPT]
    assert second_prompts == [PROMPT + policy_1 + tool] and second.n == 1
    assert first.max_tokens == 200 and second.max_tokens == 200 - len(policy_1) - len(tool)


def test_an_answer_without_a_call_is_one_policy_segment():
    run_code, calls = ran()
    [first, second], _ = episodes(["\\boxed{42}"], run_code, n=2)
    assert calls == [] and first.finish == second.finish == "answer"
    assert first.loss_mask == [1] * len("\\boxed{42}") and len(first.segments) == 1


def test_a_call_past_max_calls_ends_the_episode_unrun():
    run_code, calls = ran()
    [episode], _ = episodes(["<code>a=1</code>", "<code>b=2</code>", "done"], run_code, max_calls=1)
    assert [code for code, _ in calls] == ["a=1"]
    assert episode.finish == "call_limit" and len(episode.calls) == 1
    assert [s.source for s in episode.segments] == ["policy", "tool", "policy"]


def test_closing_a_call_never_opened_is_a_void_turn():
    run_code, calls = ran()
    [episode], _ = episodes(["no code here</code>", "unreached"], run_code)
    assert calls == [] and episode.finish == "void" and len(episode.segments) == 1


def test_a_long_output_is_cut_to_its_token_budget_and_says_so():
    run_code, _ = ran(stdout="x" * 10_000)
    [episode], _ = episodes(["<code>print('x'*10000)</code>", "ok"], run_code, max_output_tokens=64)
    tool = CHARS.decode(episode.segments[1].token_ids)
    assert len(tool) == 64 and tool.startswith("<output>\nxxx") and tool.endswith("\n[output truncated]\n</output>\n")
    assert episode.calls[0].truncated and episode.finish == "answer"


def test_the_response_budget_counts_tool_tokens_and_ends_the_episode():
    run_code, _ = ran(stdout="y" * 100)
    [episode], _ = episodes(["<code>1</code>", "never asked"], run_code, budget=40)
    assert len(episode.response_token_ids) == 40 and episode.finish == "length"
    assert [s.source for s in episode.segments] == ["policy", "tool"]


def test_a_turn_cut_by_max_tokens_is_length():
    run_code, _ = ran()
    [episode], _ = episodes(["z" * 300], run_code)
    assert episode.finish == "length" and len(episode.response_token_ids) == 200


def test_a_stopped_call_shows_why_to_the_policy():
    result = ToolResult("timeout", None, 9, "partial\n", "", False, 10.0, "bubblewrap", "wall clock 10 s")
    assert tool_output_text(result) == "partial\n\n[timeout: wall clock 10 s]"
    error = ToolResult("error", 1, None, "", "NameError: x\n", False, 0.1, "bubblewrap", "exit status 1")
    assert tool_output_text(error) == "NameError: x\n"  # the traceback says it


def test_a_tool_output_that_spells_a_special_token_stays_text():
    """Code that prints `<|endoftext|>`: the real tokenizer would read it as the EOS id, ending the policy's context
    for it; the loop tokenises tool outputs as plain text."""
    from transformers import AutoTokenizer

    from rlep.common.tiny_model import cached_model

    tokenizer = AutoTokenizer.from_pretrained(cached_model("tiny"))
    assert tokenizer.encode("<|endoftext|>", add_special_tokens=False) == [tokenizer.eos_token_id]
    turns = iter([tokenizer.encode("<code>print(x)</code>", add_special_tokens=False), [tokenizer.eos_token_id]])

    def generate(prompts, sampling):
        return [Completion(list(p), [SampleOut(next(turns), "", [-1.0], FinishReason.STOP, 0)]) for p in prompts]

    run_code, _ = ran(stdout="a<|endoftext|>b<|im_start|>assistant\n")
    prompt = tokenizer.encode("Q: x\nA: ", add_special_tokens=False)
    [[episode]] = run_episodes([prompt], Sampling(max_tokens=256), generate, run_code, tokenizer, ToolLoopConfig())
    tool = episode.segments[1]
    assert tokenizer.eos_token_id not in tool.token_ids
    assert tokenizer.decode(list(tool.token_ids)) == "<output>\na<|endoftext|>b<|im_start|>assistant\n\n</output>\n"


def test_code_the_sandbox_refuses_is_answered_and_the_others_run():
    from rlep.services.sandbox.config import SandboxConfig
    from rlep.services.sandbox.executor import check_code

    ran_codes = []

    def run_code(code: str, caller: str) -> ToolResult:  # the sandbox's own check first, as Sandbox.run does
        check_code(code, SandboxConfig(max_code_bytes=64))
        ran_codes.append(code)
        return ToolResult("ok", 0, None, "fine\n", "", False, 0.01, "bubblewrap")

    engine = ScriptedEngine(["<code>" + "x" * 100 + "</code>", "<code>a\x00</code>", "<code>1</code>", "end"])
    [[episode]] = run_episodes([CHARS.encode(PROMPT)], Sampling(max_tokens=400), engine, run_code, CHARS,
                               ToolLoopConfig())  # fmt: skip
    assert [c.status for c in episode.calls] == ["refused", "refused", "ok"] and ran_codes == ["1"]
    assert "exceeds sandbox.max_code_bytes" in CHARS.decode(episode.segments[1].token_ids)
    assert "NUL" in CHARS.decode(episode.segments[3].token_ids) and episode.finish == "answer"


def test_markers_that_leave_no_room_for_output_are_refused():
    run_code, _ = ran()
    with pytest.raises(ValueError, match="leaves no room for output"):
        episodes(["<code>1</code>"], run_code, max_output_tokens=30)


def test_later_turns_are_seeded_from_the_call_and_differ_by_turn():
    def seeds(seed):
        run_code, _ = ran()
        engine = ScriptedEngine(["<code>1</code>", "<code>2</code>", "end"])
        run_episodes([CHARS.encode(PROMPT)], Sampling(max_tokens=200, seed=seed), engine, run_code, CHARS,
                     ToolLoopConfig())  # fmt: skip
        return [sampling.seed for _, sampling in engine.calls]

    first = seeds(7)
    assert first == seeds(7) and first[0] == 7 and len(set(first)) == 3
    assert seeds(None) == [None, None, None]


# -- in the learner: tool tokens are never trained on and never in an importance ratio --------------------------------


def masked_batch():
    from rlep.common.types import Group
    from rlep.services.learner.batch import build_batch

    run_code, _ = ran()
    [episode], _ = episodes(["Let me see <code>print(6*7)</code>", " so \\boxed{42}"], run_code)
    tool = episode.to_trajectory("q1", "see 42", 1.0)
    # A sampler logprob on a tool token (a client that filled them in) is dropped all the same.
    tool = dataclasses.replace(
        tool, behavior_logprobs=tuple(-9.0 if math.isnan(lp) else lp for lp in tool.behavior_logprobs)
    )
    plain = Trajectory("q1", "43", 0.0, prompt_token_ids=tuple(CHARS.encode(PROMPT)), response_token_ids=(52, 51),
                       behavior_logprobs=(-1.0, -2.0))  # fmt: skip
    return episode, build_batch([Group("q1", "42", [tool, plain])], pad_id=0, with_behavior=True)


def test_a_tool_episode_trains_on_its_policy_tokens_only():
    episode, batch = masked_batch()
    start = len(PROMPT) - 1  # position j scores token j + 1
    row = batch.loss_mask[0, start : start + len(episode.loss_mask)]
    assert row.tolist() == [float(m) for m in episode.loss_mask] and 0.0 in row.tolist()
    assert batch.loss_mask[1].sum() == 2 and batch.response_tokens == sum(episode.loss_mask) + 2
    behavior = batch.behavior_logprobs[0, start : start + len(episode.loss_mask)]
    assert torch.isnan(behavior[row == 0]).all() and (behavior[row == 1] == -0.5).all()


def test_tool_tokens_move_neither_the_loss_nor_the_mismatch_figures():
    from rlep.services.learner.algorithm import policy_loss
    from rlep.services.learner.mismatch import rollout_mismatch

    _, batch = masked_batch()
    old = torch.full(batch.loss_mask.shape, -0.7)
    logprobs = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, batch.advantages, batch.loss_mask)
    loss.backward()
    tool = (batch.attention_mask[:, 1:] == 1) & (batch.loss_mask == 0)
    tool[:, : len(PROMPT) - 1] = False
    assert tool.sum() == len("<output>\n42\n\n</output>\n")
    assert (logprobs.grad[tool] == 0).all() and (logprobs.grad[batch.loss_mask == 1] != 0).all()
    # The -9.0 on tool tokens would move every figure, were they compared.
    figures = rollout_mismatch(old, batch.behavior_logprobs, batch.loss_mask, cap=2.0)
    assert figures.tokens == batch.response_tokens


def test_a_response_mask_must_fit_its_response():
    with pytest.raises(ValueError, match="same length"):
        Trajectory("q", "a", 0.0, response_token_ids=(1, 2), response_mask=(1,))
    with pytest.raises(ValueError, match="at least one policy token"):
        Trajectory("q", "a", 0.0, response_token_ids=(1, 2), response_mask=(0, 0))
    with pytest.raises(ValueError, match="0 \\(tool\\) and 1"):
        Trajectory("q", "a", 0.0, response_token_ids=(1, 2), response_mask=(1, 2))
    with pytest.raises(ValueError, match="excluded_from_loss is for tool episodes"):
        Trajectory("q", "a", 0.0, response_token_ids=(1, 2), excluded_from_loss=True)


def test_a_tool_trace_travels_whole_through_the_replay_contract():
    """Its mask, its calls (an exit code of None stays None) and its environment's hashes; `excluded_from_loss`, one
    step's decision of the learner, does not travel."""
    from rlep.common.types import Verdict
    from rlep.common.wire import trajectory_from_proto, trajectory_to_proto

    run_code, _ = ran(stdout="1\n")
    [episode], _ = episodes(["<code>print(1)</code>", "done"], run_code)
    killed = dataclasses.replace(episode.calls[0], status="timeout", exit_code=None, truncated=True)
    episode.calls.append(killed)
    trace = episode.to_trajectory(
        "q1", "done", 1.0, verdict=Verdict.CORRECT, chat_template_hash="c" * 32, tool_env_hash="e" * 32,
        tokenizer_fingerprint="t" * 16, excluded_from_loss=True,
    )  # fmt: skip
    back = trajectory_from_proto(trajectory_to_proto(trace))
    nan_free = {"behavior_logprobs": (), "excluded_from_loss": False}  # NaN (a tool token's logprob) != NaN
    assert dataclasses.replace(back, **nan_free) == dataclasses.replace(trace, **nan_free)
    assert [math.isnan(lp) for lp in back.behavior_logprobs] == [m == 0 for m in trace.response_mask]
    assert 0 in back.response_mask and back.tool_calls[1].exit_code is None and back.tool_calls[0].exit_code == 0


@pytest.mark.parametrize(
    ("written", "code"),
    [
        ('{"name": "python", "arguments": {"code": "print(1)"}}', "print(1)"),
        ('[{"name": "python", "arguments": {"code": "x = 2"}}]', "x = 2"),  # SmolLM2 writes a list of calls
        ('{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}', "1"),  # arguments as a JSON string
    ],
)
def test_a_json_call_gives_its_code(written, code):
    from rlep.services.learner.tool_rollouts import read_call

    assert read_call(written, ToolLoopConfig(call_format="json")) == code
    assert read_call(written, ToolLoopConfig()) == written  # `code`: the text is the code


@pytest.mark.parametrize(
    ("written", "reason"),
    [
        ("print(1)", "not JSON"),
        ('{"name": "shell", "arguments": {"code": "ls"}}', '"name": "python"'),
        ('[{"name": "python", "arguments": {"code": "1"}}, {"name": "python", "arguments": {"code": "2"}}]', "python"),
        ('{"name": "python", "arguments": {"source": "1"}}', '"code", a string'),
        ('{"name": "python", "arguments": {"code": 7}}', '"code", a string'),
        ("[]", '"name": "python"'),
    ],
)
def test_a_json_call_that_is_not_one_python_call_is_answered_and_never_run(written, reason):
    from rlep.services.learner.tool_rollouts import read_call

    with pytest.raises(ValueError, match=reason):
        read_call(written, ToolLoopConfig(call_format="json"))
    run_code, calls = ran()
    loop = {"call_open": "<tool_call>", "call_close": "</tool_call>", "call_format": "json"}
    [episode], _ = episodes([f"<tool_call>{written}</tool_call>", "\\boxed{1}"], run_code, budget=600, **loop)
    assert calls == [] and [c.status for c in episode.calls] == ["refused"] and episode.finish == "answer"
    assert reason.split()[0] in CHARS.decode(episode.segments[1].token_ids)  # the policy reads why


@pytest.fixture(scope="module")
def chatml_tokenizer():
    """The tiny tokenizer with ChatML's special tokens and template: what SmolLM2's and Qwen2.5's templates write."""
    from transformers import AutoTokenizer

    from rlep.common.tiny_model import cached_model

    tokenizer = AutoTokenizer.from_pretrained(cached_model("tiny"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def test_chat_template_markers_are_the_templates_own_tokens(chatml_tokenizer):
    """The tool's output sits in a `tool` turn exactly as the template renders one, its special tokens as their
    special ids; what the tool prints stays text even when it spells one."""
    from rlep.services.learner.tool_rollouts import template_markers

    tokenizer = chatml_tokenizer
    end, start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    assert template_markers(tokenizer) == ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    turns = iter([tokenizer.encode(call), tokenizer.encode("\\boxed{1}") + [end]])

    def generate(prompts, sampling):
        ids = next(turns)
        return [Completion(list(p), [SampleOut(ids, "", [-1.0] * len(ids), FinishReason.STOP, 0)]) for p in prompts]

    run_code, calls = ran(stdout="1<|im_end|>\n")
    loop = ToolLoopConfig(call_open="<tool_call>", call_close="</tool_call>", call_format="json",
                          output_markers="chat_template")  # fmt: skip
    asked = [{"role": "user", "content": "1?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=False))
    [[episode]] = run_episodes([prompt], Sampling(max_tokens=200), generate, run_code, tokenizer, loop)
    assert calls == [("print(1)", "episode-0")] and episode.finish == "answer"
    tool = list(episode.segments[1].token_ids)
    assert tool[0] == end and tool[2] == start
    assert tool.count(end) == 2 and tool.count(start) == 2  # the markers' specials; the printed one stays text
    # The whole episode is what the template renders for the conversation: a trainer that renders it sees these ids.
    conversation = [
        {"role": "user", "content": "1?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>',
        },
        {"role": "tool", "content": "1<|im_end|>\n"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(prompt + episode.response_token_ids) == rendered + "\\boxed{1}<|im_end|>"


def test_a_template_without_a_tool_turn_is_refused():
    from rlep.services.learner.tool_rollouts import template_markers

    class NoTools:
        def apply_chat_template(self, messages, **kwargs):
            if any(m["role"] == "tool" for m in messages):
                raise RuntimeError("Conversation roles must alternate user/assistant")
            return ""

    with pytest.raises(ValueError, match="cannot render a tool message: Conversation roles"):
        template_markers(NoTools())
