"""A step's inputs, as pure logic over scripted services: dynamic sampling's rounds and replay's accounting.

The services here are tiny scripted stand-ins (what a question's answers are, whether the pool has
it); the same code runs against the real services in tests/integration/test_learner_loop.py and
test_pretrained_e2e.py.
"""

from __future__ import annotations

import logging

import pytest

from rlep.common.dataset import Question
from rlep.common.tiny_model import ModelSpec, cached_model
from rlep.common.types import FinishReason, Group, Trajectory, Verdict
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.cursor import DataCursor
from rlep.services.learner.scored_trajectories import ReplayReport
from rlep.services.learner.step_inputs import ReplayMissingError, ServiceClients, StepInputs, StepTimer
from rlep.services.learner.tokens import PolicyTokenizer
from rlep.services.replay.types import PoolNotFound
from rlep.services.rollout.types import Completion, SampleOut

SMALL = ModelSpec(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)


class ScriptedRollout:
    """Answers question k (by its prompt's digits) correctly in the samples its script says."""

    def __init__(self, correct_per_question: dict[str, int], tokenizer: PolicyTokenizer):
        self.correct, self.tokenizer, self.calls = correct_per_question, tokenizer, 0

    def generate(self, prompts, sampling):
        self.calls += 1
        out = []
        for ids in prompts:
            key = self.tokenizer.decode(ids).split("Q: ")[-1].split("=")[0]
            right = self.correct[key]
            texts = ["right" if i < right else "wrong" for i in range(sampling.n)]
            samples = [SampleOut([3, 4], t, [-0.1, -0.2], FinishReason.STOP, 1) for t in texts]
            out.append(Completion(list(ids), samples))
        return out


class Outcome:
    def __init__(self, correct: bool):
        self.verdict = Verdict.CORRECT if correct else Verdict.WRONG
        self.reward = 1.0 if correct else -1.0


class ScriptedVerifier:
    def verify(self, items):
        return [Outcome(text.startswith("right") or text.startswith("\\boxed")) for text, _ in items]


class ScriptedReplay:
    def __init__(self, pool: dict[str, list[Trajectory]] | None):
        self.pool = pool

    def sample(self, pool, question_ids, m, strategy, seed):
        if self.pool is None:
            raise PoolNotFound(pool)  # what ReplayClient.sample raises when the server answers NOT_FOUND
        return {qid: self.pool.get(qid, [])[:m] for qid in question_ids}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model = cached_model(SMALL, cache_dir=tmp_path_factory.mktemp("models"))
    return PolicyTokenizer.load(model, max_prompt_tokens=64, max_response_tokens=16)


def questions(n: int) -> list[Question]:
    return [Question(f"q{i}", (("user", f"{i}+0=?"),), str(i)) for i in range(n)]


def inputs(tokenizer, correct, replay=None, **algorithm) -> StepInputs:
    config = TrainConfig.model_validate(
        {
            "algorithm": {
                "questions_per_step": 2,
                "fresh_per_question": 4,
                "mini_batch_questions": 1,
                "max_response_tokens": 16,
                "overlong_buffer_tokens": 0,
                **algorithm,
            }
        }
    )
    qs = questions(len(correct))
    services = ServiceClients(
        ScriptedRollout({f"{i}+0": c for i, c in enumerate(correct)}, tokenizer), ScriptedVerifier(), replay
    )
    return StepInputs(config, qs, DataCursor(len(qs), seed=0, shuffle=False), services, tokenizer)


def test_without_dynamic_sampling_one_round_of_b_questions(tokenizer):
    step = inputs(tokenizer, [4, 0, 2, 1], replayed_per_question=0)
    gathered = step.gather(0, StepTimer())
    assert [q.question_id for q in gathered.questions] == ["q0", "q1"]
    assert (gathered.rounds, gathered.groups_filtered) == (1, 0)


def test_dynamic_sampling_drops_constant_groups_and_generates_more(tokenizer):
    # q0 all right, q1 all wrong, q2 and q4 mixed, q3 all wrong, q5 mixed: two rounds of 2 fill B=2 ... 3 rounds.
    step = inputs(tokenizer, [4, 0, 2, 0, 1, 3], replayed_per_question=0, dynamic_sampling={"enabled": True})
    gathered = step.gather(0, StepTimer())
    assert [q.question_id for q in gathered.questions] == ["q2", "q4"]
    assert (gathered.rounds, gathered.questions_generated, gathered.groups_filtered) == (3, 6, 3)
    assert all(len(g) == 4 for g in gathered.fresh)


def test_dynamic_sampling_stops_at_max_rounds_and_says_so(tokenizer, caplog):
    step = inputs(tokenizer, [4, 0, 4, 0], replayed_per_question=0, dynamic_sampling={"enabled": True, "max_rounds": 2})
    with caplog.at_level(logging.WARNING):
        gathered = step.gather(0, StepTimer())
    assert gathered.rounds == 2 and gathered.groups_filtered == 4
    assert len(gathered.questions) == 2  # the last round's groups: zero advantage, but the step goes on
    assert "kept 0 of 2 groups after 2 rounds" in caplog.text


def test_replay_report_counts_what_the_pool_gave(tokenizer):
    pool = {"q0": [Trajectory("q0", "\\boxed{0}", 1.0, verdict=Verdict.CORRECT)] * 2}
    step = inputs(tokenizer, [1, 1], replay=ScriptedReplay(pool), replayed_per_question=2)
    gathered = step.gather(0, StepTimer())
    report = ReplayReport()
    replayed = step.replayed(0, gathered, report, StepTimer())
    assert list(replayed) == ["q0"] and len(replayed["q0"]) == 2
    assert report.record()["replay_requested"] == 4
    assert (report.received, report.used, report.retokenized) == (2, 2, 2)
    assert dict(report.dropped) == {"not_in_pool": 2}


@pytest.mark.parametrize("pool", [None, {}], ids=["pool-missing", "pool-empty"])
def test_no_replay_at_all_warns_or_fails_when_required(tokenizer, caplog, pool):
    step = inputs(tokenizer, [1, 1], replay=ScriptedReplay(pool), replayed_per_question=2)
    gathered = step.gather(0, StepTimer())
    with caplog.at_level(logging.WARNING):
        report = ReplayReport()
        assert step.replayed(0, gathered, report, StepTimer()) == {}
    assert "got no replayed answer" in caplog.text
    assert dict(report.dropped) == ({"pool_missing": 4} if pool is None else {"not_in_pool": 4})
    strict = inputs(tokenizer, [1, 1], replay=ScriptedReplay(pool), replayed_per_question=2, require_replay=True)
    with pytest.raises(ReplayMissingError, match="got no replayed answer"):
        strict.replayed(0, strict.gather(0, StepTimer()), ReplayReport(), StepTimer())


class ToolRollout:
    """Every episode calls the tool once, then answers from what it printed (token ids, as the engine answers)."""

    def __init__(self, tokenizer: PolicyTokenizer):
        self.hf, self.stops = tokenizer.tokenizer, []

    def generate(self, prompts, sampling):
        self.stops.append(sampling.stop)
        out = []
        for ids in prompts:
            prompt = self.hf.decode(ids)
            text = (
                f"\\boxed{{{prompt.split('<output>')[-1].split()[0]}}}"
                if "</output>" in prompt
                else "<code>print(6*7)</code>"
            )
            sample_ids = self.hf.encode(text, add_special_tokens=False)
            samples = [SampleOut(sample_ids, text, [-0.1] * len(sample_ids), FinishReason.STOP, 1)] * sampling.n
            out.append(Completion(list(ids), samples))
        return out


class BoxedVerifier:
    def __init__(self):
        self.texts = []

    def verify(self, items):
        self.texts += [text for text, _ in items]
        return [Outcome("\\boxed{42}" in text) for text, _ in items]


def test_with_tools_a_step_trains_on_tool_episodes_masked_and_records_them(tokenizer):
    from rlep.services.sandbox.types import ToolResult

    codes = []

    def run_code(code, caller):
        codes.append(code)
        return ToolResult("ok", 0, None, "42\n", "", False, 0.01, "bubblewrap")

    config = TrainConfig.model_validate(
        {"algorithm": {"questions_per_step": 2, "fresh_per_question": 2, "mini_batch_questions": 1,
                       "max_response_tokens": 64, "overlong_buffer_tokens": 0, "replayed_per_question": 0},
         "tools": {"loop": {"max_output_tokens": 64}}}
    )  # fmt: skip
    services = ServiceClients(ToolRollout(tokenizer), BoxedVerifier(), None, run_code=run_code)
    step = StepInputs(config, questions(2), DataCursor(2, seed=0, shuffle=False), services, tokenizer)
    gathered = step.gather(0, StepTimer())
    assert services.rollout.stops == [("</code>",), ("</code>",)]  # the first turn, then the continuations
    assert codes == ["print(6*7)"] * 4
    assert services.verifier.texts == ["<code>print(6*7)</code>\\boxed{42}"] * 4  # the policy's tokens only
    for t in (t for group in gathered.fresh for t in group):
        assert t.verdict == Verdict.CORRECT and t.response_text.endswith("\\boxed{42}")
        assert 0 in t.response_mask and len(t.response_mask) == len(t.response_token_ids)
    assert gathered.tools.record() == {
        "tool_calls_mean": 1.0,
        "tool_token_fraction": pytest.approx(len("<output>\n42\n\n</output>\n") / len(t.response_token_ids)),
        "tool_finishes": {"answer": 4},
        "tool_void_episodes": 0,
        "tool_void_turns": "filter",
    }


class VoidRollout(ToolRollout):
    """Episode 0 of each group answers after its call; episode 1 closes a call it never opened (`void`); episode 2
    ends its turn after the output with no answer at all (`answer`, unparseable): SimpleTIR's two void turns."""

    def generate(self, prompts, sampling):
        if sampling.n == 1:  # a continuation after the tool's output
            return super().generate(prompts, sampling)
        texts = ["<code>print(6*7)</code>", "print(6*7)</code>", "I am not sure"]
        out = []
        for ids in prompts:
            samples = []
            for text in texts:
                sample_ids = self.hf.encode(text, add_special_tokens=False)
                samples.append(SampleOut(sample_ids, text, [-0.1] * len(sample_ids), FinishReason.STOP, 1))
            out.append(Completion(list(ids), samples))
        return out


class ReadingVerifier:
    """CORRECT with a boxed 42, UNPARSEABLE without any boxed answer, WRONG otherwise (math's verdicts)."""

    def verify(self, items):
        out = []
        for text, _ in items:
            outcome = Outcome("\\boxed{42}" in text)
            if "\\boxed" not in text:
                outcome.verdict = Verdict.UNPARSEABLE
            out.append(outcome)
        return out


@pytest.mark.parametrize("void_turns", ["filter", "penalize", "keep"])
def test_void_turns_are_counted_and_filtered_penalised_or_kept(tokenizer, void_turns):
    from rlep.services.learner.batch import build_batch
    from rlep.services.sandbox.types import ToolResult

    config = TrainConfig.model_validate(
        {"algorithm": {"questions_per_step": 2, "fresh_per_question": 3, "mini_batch_questions": 1,
                       "max_response_tokens": 64, "overlong_buffer_tokens": 0, "replayed_per_question": 0},
         "tools": {"loop": {"max_output_tokens": 64}, "void_turns": void_turns, "void_penalty": 0.5}}
    )  # fmt: skip
    run_code = lambda code, caller: ToolResult("ok", 0, None, "42\n", "", False, 0.01, "bubblewrap")  # noqa: E731
    services = ServiceClients(VoidRollout(tokenizer), ReadingVerifier(), None, run_code=run_code)
    step = StepInputs(config, questions(2), DataCursor(2, seed=0, shuffle=False), services, tokenizer)
    gathered = step.gather(0, StepTimer())
    record = gathered.tools.record()
    assert record["tool_finishes"] == {"answer": 4, "void": 2}  # episode 2's unparseable end is an `answer` finish
    assert record["tool_void_episodes"] == 4 and record["tool_void_turns"] == void_turns
    for group in gathered.fresh:
        answered, closed_unopened, no_answer = group
        assert answered.verdict == Verdict.CORRECT and no_answer.verdict == Verdict.UNPARSEABLE
        assert [t.excluded_from_loss for t in group] == [False, *[void_turns == "filter"] * 2]
        penalty = 0.5 if void_turns == "penalize" else 0.0
        assert [t.reward for t in group] == [1.0, -1.0 - penalty, -1.0 - penalty]
    groups = [Group(q.question_id, q.ground_truth, g) for q, g in zip(gathered.questions, gathered.fresh, strict=True)]
    batch = build_batch(groups, pad_id=0, with_behavior=True)
    trained_rows = (batch.loss_mask.sum(dim=1) > 0).tolist()
    assert trained_rows == [True, void_turns != "filter", void_turns != "filter"] * 2
    # A filtered episode still counts in its group's advantages: the answered one's is that of 1 against two -1s.
    assert batch.advantages[0].item() == pytest.approx(batch.advantages[3].item()) and batch.advantages[0] > 0
    if void_turns == "filter":
        assert batch.behavior_logprobs[~batch.loss_mask.bool()].isnan().all()  # no importance ratio either


def test_tools_without_a_sandbox_are_refused(tokenizer):
    config = TrainConfig.model_validate({"algorithm": {"replayed_per_question": 0}, "tools": {}})
    services = ServiceClients(ToolRollout(tokenizer), BoxedVerifier(), None)
    with pytest.raises(ValueError, match="no sandbox was given"):
        StepInputs(config, questions(2), DataCursor(2, seed=0, shuffle=False), services, tokenizer)
