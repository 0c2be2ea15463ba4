"""The tool demo's pieces (issue 50, part 4): warm-up rows of tool traces hold the ids and the mask a tool episode of
the same text holds; the warm-up without traces draws what it always drew; the table's tool figures."""

from __future__ import annotations

import pytest

from rlep.common.types import FinishReason
from rlep.services.demo.task import make_problem
from rlep.services.demo.tool_task import encode_segments, tool_trace
from rlep.services.demo.warmup import WarmupConfig, encode_examples, render_prompt, training_batch
from rlep.services.learner.records import StepRecord
from rlep.services.learner.tool_rollouts import ToolLoopConfig, run_episodes
from rlep.services.rollout.types import Completion, SampleOut, Sampling
from rlep.services.sandbox.types import ToolResult
from tests.unit.test_learner_records import step_record

PROBLEM = make_problem([3, 17, 5, 9, 12])


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rlep.common.tiny_model import cached_model

    return AutoTokenizer.from_pretrained(cached_model("tiny"))


@pytest.mark.parametrize("loop", [ToolLoopConfig(), ToolLoopConfig(output_open="[out]", output_close="[/out]\n")])
def test_a_warm_up_tool_trace_is_the_episode_the_tool_loop_lays_out(tokenizer, loop):
    """The loop runs the trace's code in a sandbox stand-in that prints the sum, the engine writes the trace's policy
    turns: the episode's ids and loss mask are the warm-up row's, token for token."""
    segments = tool_trace(PROBLEM, loop)
    assert [kind for kind, _ in segments] == ["policy", "tool", "policy"]
    turns = iter([tokenizer.encode(segments[0][1], add_special_tokens=False),
                  tokenizer.encode(segments[2][1], add_special_tokens=False) + [tokenizer.eos_token_id]])  # fmt: skip
    ran = []

    def generate(prompts, sampling):
        ids = next(turns)
        return [Completion(list(p), [SampleOut(ids, "", [-0.1] * len(ids), FinishReason.STOP, 0)]) for p in prompts]

    def run_code(code: str, caller: str) -> ToolResult:
        ran.append(code)
        return ToolResult(
            "ok", 0, None, f"{sum(int(n) for n in code[6:-1].split('+'))}\n", "", False, 0.02, "bubblewrap"
        )

    prompt = tokenizer.encode(render_prompt(tokenizer, PROBLEM), add_special_tokens=False)
    [[episode]] = run_episodes([prompt], Sampling(max_tokens=120), generate, run_code, tokenizer, loop)
    assert ran == ["print(3+17+5+9+12)"] and episode.finish == "answer"
    ids, mask = encode_segments(tokenizer, segments, loop)
    assert ids == list(episode.response_token_ids) and mask == list(episode.loss_mask)
    assert tokenizer.decode(ids, skip_special_tokens=True).endswith("\\boxed{46}")


def test_tool_tokens_are_out_of_the_warm_up_loss(tokenizer):
    loop = ToolLoopConfig()
    text = "3+17=20, 20+5=25, 25+9=34, 34+12=46 \\boxed{46}"
    tokens, attention, loss_mask = encode_examples(tokenizer, [PROBLEM, PROBLEM], [text, tool_trace(PROBLEM, loop)],
                                                   loop)  # fmt: skip
    prompt = len(tokenizer.encode(render_prompt(tokenizer, PROBLEM), add_special_tokens=False))
    trained = [tokenizer.decode(tokens[i, 1:][loss_mask[i] > 0].tolist()) for i in range(2)]
    assert trained[0] == text + tokenizer.eos_token  # a worked solution: every completion token, as before
    assert trained[1] == "<code>print(3+17+5+9+12)</code> \\boxed{46}" + tokenizer.eos_token  # the tool's left out
    ids, mask = encode_segments(tokenizer, tool_trace(PROBLEM, loop), loop)
    assert int(attention[1].sum()) == prompt + len(ids) and 0 < sum(mask) < len(mask)


def test_the_warm_up_without_tool_traces_draws_what_it_always_drew():
    """`make demo` unchanged: with tool_share 0 the batch is the worked solutions of the seeded draw, and a share
    turns about that many into traces, the same ones for the same seed."""
    plain = training_batch(3, 0, WarmupConfig())
    assert all(isinstance(c, str) for c in plain[1]) and plain[1][0].endswith(f"\\boxed{{{plain[0][0].answer}}}")
    mixed = WarmupConfig(tool_share=0.25, batch_size=400, terms=5)
    problems, completions = training_batch(3, 0, mixed)
    traces = [i for i, c in enumerate(completions) if not isinstance(c, str)]
    assert 0.18 < len(traces) / len(problems) < 0.32
    assert traces == [i for i, c in enumerate(training_batch(3, 0, mixed)[1]) if not isinstance(c, str)]
    again = training_batch(3, 0, mixed.model_copy(update={"tool_share": 0.0}))
    assert [c for i, c in enumerate(completions) if i not in traces] == [
        c for i, c in enumerate(again[1]) if i not in traces
    ]


def test_the_table_counts_tool_calls_and_void_episodes_per_episode():
    from rlep.services.demo.tool_runner import summarize, tool_use

    def step(n: int, calls: float, void: int, accuracy: float) -> StepRecord:
        return step_record(step=n, eval_accuracy=accuracy, step_seconds=1.0, tool_calls_mean=calls,
                           tool_finishes={"answer": 6, "void": 2}, tool_void_episodes=void)  # fmt: skip

    runs = [step(n, 0.5 if n <= 10 else 1.0, 2 if n <= 10 else 0, accuracy=n / 100) for n in range(1, 21)]
    assert tool_use(runs, first=True) == {"calls_per_episode": 0.5, "void_share": 0.25}
    assert tool_use(runs, first=False) == {"calls_per_episode": 1.0, "void_share": 0.0}
    plain = [step_record(step=n, eval_accuracy=0.05) for n in (1, 2)]  # no tools: no tool figures
    summary = summarize({"tools": runs, "no tools": plain})
    assert summary["arms"]["tools"]["peak"] == 0.2 and summary["arms"]["tools"]["steps_to_tools_peak"] == 20
    assert summary["arms"]["no tools"]["steps_to_tools_peak"] is None
    assert summary["arms"]["no tools"]["early"] == {"calls_per_episode": None, "void_share": None}


def test_the_three_runs_differ_only_in_tools_warm_up_and_replay(tmp_path):
    from rlep.services.demo.tool_runner import ARMS, arm_config, load_tool_demo_config

    demo = load_tool_demo_config(flags={"out_dir": tmp_path})
    data, evals = tmp_path / "train.parquet", tmp_path / "eval.parquet"
    configs = {arm: arm_config(demo, arm, tmp_path / "warm", data, evals) for arm in ARMS}
    assert configs["no tools"].tools is None
    assert configs["tools"].tools == configs["tools + RLEP"].tools == demo.tools
    assert [c.algorithm.replayed_per_question for c in configs.values()] == [0, 0, demo.replayed_per_question]
    assert len({c.run_id for c in configs.values()}) == 3  # each run its own checkpoints and log
    shared = [c.model_dump(exclude={"run_id", "tools", "checkpoint", "algorithm"}) for c in configs.values()]
    assert shared[0] == shared[1] == shared[2]
    assert demo.tools.loop.max_output_tokens < demo.max_response_tokens  # an output fits in an episode's budget
