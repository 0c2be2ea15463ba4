"""The learner's tokenizer side: prompt truncation, replayed answers re-tokenised, fingerprints, reward rules, and
the tokenizer files a saved checkpoint takes along."""

from __future__ import annotations

import pytest

from rlep.common.tiny_model import ModelSpec, cached_model
from rlep.common.types import FinishReason, Source, Trajectory, Verdict
from rlep.services.learner.config import AlgorithmConfig
from rlep.services.learner.scored_trajectories import ReplayReport, group_varies, prepare_replayed, score_replayed
from rlep.services.learner.tokens import EncodedPrompt, PolicyTokenizer, tokenizer_fingerprint

SMALL = ModelSpec(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)
QUESTION = [{"role": "user", "content": "12+30+7=?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cached_model(SMALL, cache_dir=tmp_path_factory.mktemp("models")))


def make(hf_tokenizer, max_prompt=1024, max_response=64) -> PolicyTokenizer:
    return PolicyTokenizer(hf_tokenizer, max_prompt, max_response)


def test_prompt_is_the_chat_template_as_rollout_renders_it(hf_tokenizer):
    tok = make(hf_tokenizer)
    text = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert tok.encode_prompt(QUESTION) == EncodedPrompt(tuple(hf_tokenizer.encode(text, add_special_tokens=False)), 0)


def test_long_prompts_are_left_truncated_and_counted(hf_tokenizer):
    full = make(hf_tokenizer).encode_prompt(QUESTION).token_ids
    cut = make(hf_tokenizer, max_prompt=5).encode_prompt(QUESTION)
    assert cut.token_ids == full[-5:]  # the end (question tail + generation prompt) survives
    assert cut.truncated_tokens == len(full) - 5


def test_prompt_budget_shrinks_to_fit_the_model_length(hf_tokenizer):
    tok = make(hf_tokenizer, max_prompt=1024, max_response=100)
    tok.fit_model_length(112)
    assert tok.max_prompt_tokens == 12
    with pytest.raises(ValueError, match="leaves no room"):
        make(hf_tokenizer, max_response=100).fit_model_length(100)


def test_response_gets_eos_and_is_cut_to_the_limit(hf_tokenizer):
    tok = make(hf_tokenizer, max_response=6)
    short = tok.encode_response("\\boxed{49}")
    assert short.token_ids[-1] == tok.eos_id and not short.truncated
    assert tok.decode(short.token_ids) == "\\boxed{49}"
    long = tok.encode_response("12 + 30 = 42, 42 + 7 = 49")
    assert len(long.token_ids) == 6 and long.truncated and tok.eos_id not in long.token_ids


def test_fingerprint_tells_tokenizers_apart(hf_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    hf_tokenizer.save_pretrained(tmp_path / "same")
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "same")) == tokenizer_fingerprint(
        hf_tokenizer
    )
    other = AutoTokenizer.from_pretrained(tmp_path / "same")
    other.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(hf_tokenizer)


def stored(text: str, ids=(), fingerprint="", reward=1.0) -> Trajectory:
    return Trajectory(
        "q",
        text,
        reward,
        Source.REPLAY,
        Verdict.CORRECT,
        response_token_ids=tuple(ids),
        tokenizer_fingerprint=fingerprint,
    )


def test_replayed_answers_take_the_steps_prompt_and_policy_tokens(hf_tokenizer):
    tok = make(hf_tokenizer, max_response=8)
    prompt = tok.encode_prompt(QUESTION)
    own_ids = (5, 6, 7)  # deliberately not what encoding the text gives: kept only when fingerprints match
    sampled = {
        "q": [
            stored("\\boxed{49}"),  # released pool: text only
            stored("\\boxed{49} ", own_ids, tok.fingerprint),  # ours
            stored("\\boxed{49}  ", own_ids, "another-tokenizer"),
            stored("   "),  # nothing to train on
            stored("12 + 30 = 42, 42 + 7 = 49, \\boxed{49}"),  # longer than the limit
        ]
    }
    report = ReplayReport(requested=6)
    out = prepare_replayed(sampled, {"q": prompt}, tok, report)["q"]

    assert [t.prompt_token_ids for t in out] == [prompt.token_ids] * 4
    assert all(t.source == Source.REPLAY and t.tokenizer_fingerprint == tok.fingerprint for t in out)
    assert tok.decode(out[0].response_token_ids) == "\\boxed{49}" and out[0].response_token_ids[-1] == tok.eos_id
    assert out[1].response_token_ids == own_ids
    assert out[2].response_token_ids != own_ids and tok.decode(out[2].response_token_ids) == "\\boxed{49}  "
    assert len(out[3].response_token_ids) == 8 and out[3].finish_reason == FinishReason.LENGTH
    assert (report.received, report.retokenized, report.truncated, dict(report.dropped)) == (
        5,
        3,
        1,
        {"empty_answer": 1},
    )


def test_replayed_rewards_come_from_the_verifier_and_get_overlong_shaping():
    algo = AlgorithmConfig(max_response_tokens=10, overlong_buffer_tokens=4)

    class Outcome:
        def __init__(self, verdict, reward):
            self.verdict, self.reward = verdict, reward

    group = {"q": [stored("a", ids=range(4)), stored("b", ids=range(10))]}
    report = ReplayReport()
    outcomes = {"q": [Outcome(Verdict.CORRECT, 1.0), Outcome(Verdict.WRONG, -1.0)]}
    scored = score_replayed(group, outcomes, algo, report)["q"]
    assert [t.reward for t in scored] == [1.0, -2.0]  # 10 tokens = the limit: full penalty
    assert [t.verdict for t in scored] == [Verdict.CORRECT, Verdict.WRONG]
    assert (report.used, report.failed_verification) == (2, 1)
    trusted = score_replayed(group, None, algo, ReplayReport())["q"]
    assert [t.reward for t in trusted] == [1.0, 0.0]  # stored reward 1.0, minus the overlong penalty


def test_dynamic_sampling_keeps_groups_whose_rewards_vary():
    def group(*verdicts, rewards=None):
        rewards = rewards or [1.0 if v == Verdict.CORRECT else -1.0 for v in verdicts]
        return [Trajectory("q", str(i), r, verdict=v) for i, (v, r) in enumerate(zip(verdicts, rewards, strict=True))]

    assert group_varies(group(Verdict.CORRECT, Verdict.WRONG), "acc")
    assert not group_varies(group(Verdict.CORRECT, Verdict.CORRECT), "acc")
    # Same correctness, different shaped rewards: only the `score` metric sees a difference.
    shaped = group(Verdict.WRONG, Verdict.WRONG, rewards=[-1.0, -1.5])
    assert not group_varies(shaped, "acc") and group_varies(shaped, "score")


def test_copy_tokenizer_files_takes_every_tokenizer_file_and_nothing_else(tmp_path):
    from rlep.services.learner.policy import copy_tokenizer_files

    source, target = tmp_path / "source", tmp_path / "target"
    tokenizer_files = [
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
        "generation_config.json",
        "additional_chat_templates/tool_use.jinja",
    ]
    for name in [*tokenizer_files, "config.json", "model.safetensors", "rlep_model_spec.json"]:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(name)
    target.mkdir()
    copy_tokenizer_files(source, target)
    copied = {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()}
    assert copied == set(tokenizer_files)
    assert all((target / name).read_text() == name for name in tokenizer_files)
