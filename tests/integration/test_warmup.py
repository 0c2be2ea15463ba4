"""Supervised warm-up on a very small model: the loss falls and the checkpoint loads back in transformers."""

from __future__ import annotations

import json

import pytest

from rlep.common.tiny_model import ModelSpec, cached_model
from rlep.services.demo.task import is_correct, make_problem, make_problems
from rlep.services.demo.warmup import (
    RESULT_FILE,
    WarmupConfig,
    completion_loss,
    encode_examples,
    lr_at,
    pass_at_1,
    sample_completions,
    warmup,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ModelSpec(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)
CONFIG = WarmupConfig(batch_size=32, lr=1e-2, lr_warmup_steps=5, max_value=20, eval_problems=16, max_new_tokens=24)


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    return cached_model(SMALL, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def warmed(source_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("warm") / "ckpt"
    return warmup(source_dir, out_dir, steps=40, seed=0, config=CONFIG, progress=False)


def test_loss_mask_covers_the_completion_and_its_eos(source_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    problem = make_problem([23, 5, 17])
    tokens, attention, loss_mask = encode_examples(
        tokenizer, [problem, make_problem([1, 2, 3])], [problem.solution] * 2
    )
    prompt_len = len(tokenizer.encode("Q: 23+5+17=?\nA: ", add_special_tokens=False))
    completion_len = len(tokenizer.encode(problem.solution, add_special_tokens=False)) + 1
    assert int(attention[0].sum()) == prompt_len + completion_len == tokens.shape[1]
    assert loss_mask[0].nonzero().flatten().tolist() == list(range(prompt_len - 1, prompt_len + completion_len - 1))
    assert tokenizer.decode(tokens[0, prompt_len:]) == problem.solution + tokenizer.eos_token
    assert int(attention[1].sum()) < tokens.shape[1] and loss_mask[1, int(attention[1].sum()) - 1 :].sum() == 0


def test_lr_warms_up_linearly_then_decays_to_the_floor():
    config = WarmupConfig(lr=1.0, lr_warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, config) == pytest.approx(0.1) and lr_at(9, 100, config) == pytest.approx(1.0)
    assert lr_at(55, 100, config) == pytest.approx(0.55) and lr_at(100, 100, config) == pytest.approx(0.1)
    assert all(lr_at(s, 100, config) >= lr_at(s + 1, 100, config) for s in range(10, 100))


def test_warmup_lowers_the_loss_and_reports_pass_at_1(warmed):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert len(warmed.losses) == 40
    assert sum(warmed.losses[-5:]) / 5 < 0.7 * sum(warmed.losses[:5]) / 5
    # pass@1 is a count of the 16 evaluation problems: k / 16, as saved.
    solved = warmed.pass_at_1 * CONFIG.eval_problems
    assert solved == round(solved) and warmed.eval_problems == CONFIG.eval_problems
    saved = json.loads((warmed.out_dir / RESULT_FILE).read_text())
    assert saved["steps"] == 40 and saved["pass_at_1"] == warmed.pass_at_1 and saved["config"]["max_value"] == 20
    # The figure is the fraction of sampled completions that box the right sum: recount one seeded sample.
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(warmed.out_dir),
        AutoTokenizer.from_pretrained(warmed.out_dir),
    )
    problems = make_problems(
        CONFIG.eval_problems, seed=CONFIG.eval_seed, split="eval", terms=CONFIG.terms, max_value=CONFIG.max_value
    )
    torch.manual_seed(7)
    texts = sample_completions(model, tokenizer, problems, CONFIG.max_new_tokens)
    torch.manual_seed(7)
    score = pass_at_1(model, tokenizer, problems, CONFIG.max_new_tokens)
    assert score == sum(is_correct(t, p) for t, p in zip(texts, problems, strict=True)) / len(problems)
    assert is_correct(problems[0].solution, problems[0]) and not is_correct("\\boxed{-1}", problems[0])


def test_checkpoint_round_trips_through_the_auto_classes(warmed, source_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(warmed.out_dir)  # vLLM's path: must stay character level
    text = "Q: 23+5+17=?\nA: 23+5=28, 28+17=45 \\boxed{45}"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and tokenizer.convert_tokens_to_ids("\\boxed{") in ids
    messages = [{"role": "user", "content": "23+5+17=?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "Q: 23+5+17=?\nA: "

    trained = AutoModelForCausalLM.from_pretrained(warmed.out_dir)
    initial = AutoModelForCausalLM.from_pretrained(source_dir)
    problems = make_problems(64, seed=99, split="eval", max_value=20)
    batch = encode_examples(tokenizer, problems, [p.solution for p in problems])
    with torch.no_grad():
        assert completion_loss(trained, *batch) < completion_loss(initial, *batch) - 0.5
    trained.save_pretrained(warmed.out_dir.parent / "again")
    again = AutoModelForCausalLM.from_pretrained(warmed.out_dir.parent / "again")
    assert all(
        torch.equal(a, b) for a, b in zip(trained.state_dict().values(), again.state_dict().values(), strict=True)
    )


class SolvingModel:
    """A stand-in for the model in `pass_at_1`: it writes the worked solution of the problems listed in `solves`
    and a wrong boxed sum for the others (a pure count check; the real model solves too few of 16 to show one)."""

    def __init__(self, tokenizer, problems, solves: set[int]):
        self.tokenizer = tokenizer
        self.by_question = {p.question: (p, i in solves) for i, p in enumerate(problems)}

    def eval(self):
        return self

    def generate(self, input_ids, max_new_tokens, **_):
        import torch

        rows = []
        for ids in input_ids.tolist():
            question = self.tokenizer.decode(ids).split("Q: ")[-1].split("\n")[0]
            problem, solved = self.by_question[question]
            text = problem.solution if solved else f"\\boxed{{{int(problem.answer) + 1}}}"
            new = self.tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens]
            rows.append(ids + new + [self.tokenizer.eos_token_id] * (max_new_tokens + 1 - len(new)))
        return torch.tensor(rows)


def test_pass_at_1_is_the_fraction_of_problems_solved(source_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    problems = make_problems(16, seed=3, split="eval", max_value=20)
    solves = {0, 3, 4, 9, 15}
    model = SolvingModel(tokenizer, problems, solves)
    assert pass_at_1(model, tokenizer, problems, max_new_tokens=40) == len(solves) / 16
