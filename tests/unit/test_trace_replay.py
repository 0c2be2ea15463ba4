"""Replay of tool traces on the learner's side (issue 50, part 3), as pure logic over a real tokenizer: which stored
traces a run may train on (`prepare_replayed` with `TraceRules`), replay's token share (`within_token_share`), and
a step with tools that replays a trace whole (StepInputs over scripted services; the real replay service keeps
traces in tests/integration/test_replay_service.py)."""

from __future__ import annotations

import dataclasses

import pytest

from rlep.common.tiny_model import cached_model
from rlep.common.types import FinishReason, Source, ToolCall, Trajectory, Verdict
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.cursor import DataCursor
from rlep.services.learner.scored_trajectories import (
    ReplayReport,
    TraceRules,
    prepare_replayed,
    within_token_share,
)
from rlep.services.learner.step_inputs import ServiceClients, StepInputs, StepTimer
from rlep.services.learner.tokens import EncodedPrompt, PolicyTokenizer
from rlep.services.learner.tool_rollouts import chat_template_hash, tool_env_hash
from rlep.services.rollout.types import SampleOut
from tests.unit.test_step_inputs import SMALL, BoxedVerifier, ToolRollout, questions

PROMPT = EncodedPrompt((11, 12, 13))
LIMIT = 16  # the tokenizer's response limit: a longer trace is not replayed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model = cached_model(SMALL, cache_dir=tmp_path_factory.mktemp("models"))
    return PolicyTokenizer.load(model, max_prompt_tokens=64, max_response_tokens=LIMIT)


@pytest.fixture(scope="module")
def long_tokenizer(tmp_path_factory):
    model = cached_model(SMALL, cache_dir=tmp_path_factory.mktemp("models"))
    return PolicyTokenizer.load(model, max_prompt_tokens=64, max_response_tokens=64)


RULES = TraceRules("chat", "env", run_id="run-b", policy_version=10, max_staleness=3)


def trace(tokenizer, **fields) -> Trajectory:
    base = dict(
        question_id="q0",
        response_text="<code>print(6*7)</code><output>\n42\n</output>\\boxed{42}",
        reward=1.0,
        verdict=Verdict.CORRECT,
        prompt_token_ids=PROMPT.token_ids,
        response_token_ids=(1, 2, 3, 4, 5),
        response_mask=(1, 1, 0, 0, 1),
        tokenizer_fingerprint=tokenizer.fingerprint,
        chat_template_hash="chat",
        tool_env_hash="env",
        tool_calls=(ToolCall("print(6*7)", "ok", 0, "42\n", "", 0.01, False),),
        run_id="run-a",
        policy_version=1,
    )
    return Trajectory(**{**base, **fields})


def prepared(tokenizer, t: Trajectory, rules: TraceRules | None = RULES) -> tuple[list[Trajectory], ReplayReport]:
    report = ReplayReport()
    out = prepare_replayed({"q0": [t]}, {"q0": PROMPT}, tokenizer, report, rules)
    return out.get("q0", []), report


def test_a_trace_of_the_same_environment_is_replayed_as_stored(tokenizer):
    stored = trace(tokenizer)
    [row], report = prepared(tokenizer, stored)
    assert row.source == Source.REPLAY and row.behavior_logprobs == ()
    assert (row.response_token_ids, row.response_mask, row.tool_calls) == (
        stored.response_token_ids,
        stored.response_mask,
        stored.tool_calls,
    )
    assert report.retokenized == 0 and not report.dropped


@pytest.mark.parametrize(
    ("fields", "rules", "reason"),
    [
        ({}, None, "trace_without_tools"),  # a run without tools would train on the tool's outputs
        ({"tool_env_hash": "another sandbox"}, RULES, "trace_env_changed"),
        ({"chat_template_hash": "another template"}, RULES, "trace_env_changed"),
        ({"tokenizer_fingerprint": "another tokenizer"}, RULES, "trace_env_changed"),
        ({"prompt_token_ids": (11, 12, 99)}, RULES, "trace_prompt_changed"),
        ({"response_token_ids": (1,) * (LIMIT + 1), "response_mask": (1,) * (LIMIT + 1)}, RULES, "trace_too_long"),
        ({"run_id": "run-b", "policy_version": 6}, RULES, "trace_stale"),  # this run's own, 4 versions old
    ],
)
def test_a_trace_that_does_not_fit_this_run_is_dropped_never_retokenised(tokenizer, fields, rules, reason):
    rows, report = prepared(tokenizer, trace(tokenizer, **fields), rules)
    assert rows == [] and report.dropped == {reason: 1} and report.retokenized == 0


def test_staleness_counts_only_this_runs_own_traces(tokenizer):
    """A phase-1 pool's traces carry another run's versions: any age replays, as single answers do."""
    assert prepared(tokenizer, trace(tokenizer, run_id="run-b", policy_version=7))[0]  # 3 versions: within
    assert prepared(tokenizer, trace(tokenizer, run_id="phase-1", policy_version=500))[0]
    assert prepared(
        tokenizer, trace(tokenizer, run_id="run-b", policy_version=1), dataclasses.replace(RULES, max_staleness=None)
    )[0]


def test_replay_stays_within_its_token_share_question_by_question():
    def rows(qid: str, *lengths: int) -> list[Trajectory]:
        return [Trajectory(qid, f"{qid}{i}", 1.0, response_token_ids=(1,) * n) for i, n in enumerate(lengths)]

    replayed = {"a": rows("a", 30, 10), "b": rows("b", 40, 5), "c": rows("c", 100)}
    report = ReplayReport()
    # 0.25 of the step's tokens with 240 fresh: replay may take 80. First rows first: a0 (30) + b0 (40) = 70, c0
    # (100) does not fit; then a1 (10) = 80; b1 (5) would pass 80.
    kept = within_token_share(replayed, fresh_tokens=240, max_fraction=0.25, report=report)
    assert {qid: [t.response_text for t in rows] for qid, rows in kept.items()} == {"a": ["a0", "a1"], "b": ["b0"]}
    assert report.dropped == {"token_budget": 2}
    assert within_token_share(replayed, 240, 1.0, ReplayReport()) == replayed


class TracePool:
    """The pool the step draws from: one stored trace and one single answer for each question."""

    def __init__(self, rows: dict[str, list[Trajectory]]):
        self.rows, self.asked = rows, []

    def sample(self, pool, question_ids, m, strategy, seed):
        self.asked.append(m)
        return {qid: self.rows.get(qid, [])[:m] for qid in question_ids}


def test_a_step_with_tools_replays_a_trace_whole_and_verifies_its_policy_tokens_only(long_tokenizer):
    from rlep.services.sandbox.types import ToolResult

    tokenizer, hf = long_tokenizer, long_tokenizer.tokenizer
    config = TrainConfig.model_validate(
        {"algorithm": {"questions_per_step": 1, "fresh_per_question": 2, "mini_batch_questions": 1,
                       "max_response_tokens": 64, "overlong_buffer_tokens": 0, "replayed_per_question": 2},
         "tools": {"loop": {"max_output_tokens": 64}, "replay": {"max_token_fraction": 0.9}}, "run_id": "run-b"}
    )  # fmt: skip
    prompt = tokenizer.encode_prompt(questions(1)[0].chat()).token_ids
    policy = hf.encode("<code>print(6*7)</code>", add_special_tokens=False)
    tool = hf.encode("<output>\n\\boxed{42}\n</output>\n", add_special_tokens=False)
    answer = hf.encode("\\boxed{41}", add_special_tokens=False)
    ids = (*policy, *tool, *answer)
    stored = trace(
        tokenizer, prompt_token_ids=prompt, response_token_ids=ids, response_text=hf.decode(ids),
        response_mask=(1,) * len(policy) + (0,) * len(tool) + (1,) * len(answer),
        chat_template_hash=chat_template_hash(hf), tool_env_hash=tool_env_hash(config.tools),
    )  # fmt: skip
    single = Trajectory("q0", "\\boxed{42}", 1.0, verdict=Verdict.CORRECT)
    run_code = lambda code, caller: ToolResult("ok", 0, None, "42\n", "", False, 0.01, "bubblewrap")  # noqa: E731
    verifier = BoxedVerifier()
    pool = TracePool({"q0": [stored, single]})
    services = ServiceClients(ToolRollout(tokenizer), verifier, pool, run_code=run_code)
    step = StepInputs(config, questions(1), DataCursor(1, seed=0, shuffle=False), services, tokenizer)
    assert step.trace_env == {"chat_template_hash": stored.chat_template_hash, "tool_env_hash": stored.tool_env_hash}
    gathered = step.gather(0, StepTimer())
    report = ReplayReport()
    replayed = step.replayed(0, gathered, report, StepTimer(), policy_version=3)
    trace_row, single_row = replayed["q0"]
    assert trace_row.response_token_ids == ids and trace_row.response_mask == stored.response_mask
    # The stored trace's tool output printed \boxed{42}; its policy wrote \boxed{41}: re-verified on the policy's
    # tokens, it is no success (BoxedVerifier: correct only with \boxed{42} in the text it is given).
    assert verifier.texts[-2:] == ["<code>print(6*7)</code>\\boxed{41}", "\\boxed{42}"]
    assert trace_row.verdict == Verdict.WRONG and single_row.verdict == Verdict.CORRECT
    assert report.record()["replay_traces"] == 1 and report.used == 2 and report.failed_verification == 1


def test_phase_1_with_tools_stores_whole_traces_and_leaves_void_ones_out(long_tokenizer):
    """`collect` with the run's tools: each success is stored as its trace (ids, mask, calls, the environment's
    hashes the learner checks); an episode ending in a void turn is not stored."""
    from rlep.services.learner.collect import CollectConfig, collect, run_settings
    from rlep.services.learner.tool_rollouts import ToolUseConfig
    from rlep.services.sandbox.types import ToolResult
    from tests.unit.test_collect import Replay
    from tests.unit.test_step_inputs import ReadingVerifier, VoidRollout

    tools = ToolUseConfig.model_validate({"loop": {"max_output_tokens": 64}})
    run_code = lambda code, caller: ToolResult("ok", 0, None, "42\n", "", False, 0.01, "bubblewrap")  # noqa: E731
    replay = Replay()

    class Rollout(VoidRollout):
        """The closed-unopened episode writes a right answer first: verified CORRECT, and still void."""

        def generate(self, prompts, sampling):
            out = super().generate(prompts, sampling)
            if sampling.n > 1:
                text = "\\boxed{42} print(6*7)</code>"
                ids = self.hf.encode(text, add_special_tokens=False)
                for completion in out:
                    completion.samples[1] = SampleOut(ids, text, [-0.1] * len(ids), FinishReason.STOP, 1)
            return out

        def max_model_len(self) -> int:
            return 512

    services = ServiceClients(Rollout(long_tokenizer), ReadingVerifier(), replay, run_code=run_code)
    config = CollectConfig(samples_per_question=3, min_successes=1, max_response_tokens=64)
    stats = collect(services, questions(2), "p", config, show_progress=False, tokenizer=long_tokenizer, tools=tools)
    assert (stats.questions_kept, stats.samples, stats.successes_stored) == (2, 6, 2)
    for t in replay.added:  # each question's answered episode; the closed-unopened (right) and unanswered are void
        assert t.verdict == Verdict.CORRECT and t.source == Source.REPLAY
        assert 0 in t.response_mask and [c.code for c in t.tool_calls] == ["print(6*7)"]
        assert (t.chat_template_hash, t.tool_env_hash) == (
            chat_template_hash(long_tokenizer.tokenizer),
            tool_env_hash(tools),
        )
        assert t.tokenizer_fingerprint == long_tokenizer.fingerprint
    assert run_settings(config, questions(2), "p", tools=tools)["tools"]["loop"]["max_output_tokens"] == 64
    assert "tools" not in run_settings(config, questions(2), "p")  # a state of a collection without tools resumes


def test_a_run_refuses_a_sandbox_service_whose_outputs_depend_on_other_settings():
    """Its traces' tool_env_hash is computed from the run's own tools.sandbox: a service with other limits would make
    them lie. Scheduling (concurrency, the cache) changes no output and is not compared."""
    from rlep.common.errors import UserError
    from rlep.services.launch.stack import check_same_sandbox
    from rlep.services.sandbox.config import SandboxConfig

    mine = SandboxConfig(cpu_seconds=5)
    check_same_sandbox(mine, SandboxConfig(cpu_seconds=5, concurrency=8, cache_entries=0).environment(), "sb:50064")
    with pytest.raises(UserError, match="cpu_seconds: this run 5, the service 9"):
        check_same_sandbox(mine, SandboxConfig(cpu_seconds=9).environment(), "sb:50064")
