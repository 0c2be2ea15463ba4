"""The locally built tiny model: loads through the Auto classes (vLLM's path) and round-trips text."""

from __future__ import annotations

import pytest

from rlep.common.tiny_model import EOS, ModelSpec, cached_model, tokenizer_vocab

SMALL = ModelSpec(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return cached_model(SMALL, cache_dir=tmp_path_factory.mktemp("models"))


def test_tokenizer_round_trips_through_auto_tokenizer(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "Q: 23+58=?\nA: 23 + 58 = 81, so \\boxed{81} ~!@#"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids("\\boxed{") in ids  # one token, not seven
    assert len(ids) == len(text) - len("\\boxed{") + 1
    assert tokenizer.eos_token == EOS and len(tokenizer) == len(tokenizer_vocab())


def test_chat_template_renders_question_and_answer(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "2+2=?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "Q: 2+2=?\nA: "


def test_checkpoint_loads_in_transformers_and_is_cached(model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.vocab_size == SMALL.vocab_size and model.config.num_hidden_layers == 1
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert cached_model(SMALL, cache_dir=model_dir.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model preset"):
        cached_model("gigantic")
