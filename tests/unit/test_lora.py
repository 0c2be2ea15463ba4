"""LoRA on the tiny model without DeepSpeed (services/learner/lora.py): what trains, the merged weights, the adapter
switched off, the adapter-only state dict, and the config's defaults and refusals."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rlep.services.learner.batch import ScoringModel
from rlep.services.learner.config import LORA_TARGETS, LoraConfig, TrainConfig
from rlep.services.learner.lora import AdapterScoringModel, apply_lora, merged_weights, model_skeleton

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir():
    from rlep.common.tiny_model import cached_model

    return cached_model("tiny")


def load(model_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture
def wrapped(model_dir) -> torch.nn.Module:
    """The tiny model with LoRA, its B matrices made non-zero (as after training), so the adapters change outputs."""
    torch.manual_seed(0)
    model = apply_lora(load(model_dir), LORA)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.05)
    return model


def test_lora_is_off_by_default_and_needs_a_target():
    assert not TrainConfig().lora.enabled and TrainConfig().lora.rank == 0
    assert TrainConfig().lora.target_modules == LORA_TARGETS
    with pytest.raises(ValidationError):
        TrainConfig.model_validate({"lora": {"rank": 8, "target_modules": []}})
    assert TrainConfig.model_validate({"lora": {"rank": 8}, "deepspeed": {"zero_stage": 2}}).lora.enabled


def test_only_the_adapters_train(model_dir):
    model = apply_lora(load(model_dir), LORA)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    adapters = {name for name, _ in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}
    assert trained == adapters
    # One A [4, in] and one B [out, 4] on each of the 7 projections of each of the tiny model's layers.
    layers = load(model_dir).config.num_hidden_layers
    assert len(adapters) == 2 * len(LORA_TARGETS) * layers


def test_an_embedding_target_is_refused(model_dir):
    with pytest.raises(ValueError, match="only linear layers"):
        apply_lora(load(model_dir), LoraConfig(rank=4, target_modules=["embed_tokens"]))


def test_a_target_that_names_no_module_is_refused_with_the_ones_there(model_dir):
    """Before: PEFT adapted `q_proj` and dropped the misspelt `vproj` without a word."""
    with pytest.raises(ValueError, match=r"vproj matches no module .* q_proj, k_proj, v_proj"):
        apply_lora(load(model_dir), LoraConfig(rank=4, target_modules=["q_proj", "vproj"]))
    apply_lora(load(model_dir), LoraConfig(rank=4, target_modules=["self_attn.q_proj"]))  # PEFT's dotted suffix


def test_the_skeleton_checked_before_start_has_the_models_modules(model_dir):
    skeleton = model_skeleton(str(model_dir))
    assert [name for name, _ in skeleton.named_modules()] == [name for name, _ in load(model_dir).named_modules()]
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}  # no weights read or allocated


def test_merged_weights_are_the_plain_models_with_w_plus_scaled_b_a(model_dir, wrapped):
    plain = load(model_dir).state_dict()
    merged = dict(merged_weights(wrapped, torch.float32, skip=frozenset({"lm_head.weight"})))
    assert list(merged) == [name for name in plain if name != "lm_head.weight"]  # names and order of the plain model
    adapted = 0
    for name, tensor in merged.items():
        owner = name.removesuffix(".weight")
        if owner.rsplit(".", 1)[-1] in LORA_TARGETS and name.endswith(".weight"):
            layer = wrapped.get_base_model().get_submodule(owner)
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            torch.testing.assert_close(tensor, plain[name] + (LORA.alpha / LORA.rank) * b @ a, rtol=0, atol=1e-6)
            assert not torch.equal(tensor, plain[name])
            adapted += 1
        else:
            assert torch.equal(tensor, plain[name]), name
    assert adapted == len(LORA_TARGETS) * load(model_dir).config.num_hidden_layers
    # The training weights are not merged into: the base layers still hold W.
    base = wrapped.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert torch.equal(base, plain["model.layers.0.self_attn.q_proj.weight"])


def test_merged_weights_compute_what_the_wrapped_model_computes(model_dir, wrapped):
    ids = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    plain = load(model_dir)
    plain.load_state_dict(dict(merged_weights(wrapped, torch.float32)))
    wrapped.eval()
    lora_logprobs, _ = ScoringModel(wrapped)(ids, mask, with_entropy=False)
    merged_logprobs, _ = ScoringModel(plain)(ids, mask, with_entropy=False)
    torch.testing.assert_close(lora_logprobs, merged_logprobs, rtol=1e-5, atol=1e-5)
    # In bf16 the merged tensors are the float32 merge rounded once.
    bf16 = dict(merged_weights(wrapped, torch.bfloat16))
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert torch.equal(bf16["model.layers.0.mlp.up_proj.weight"], plain.model.layers[0].mlp.up_proj.weight.bfloat16())


def test_with_the_adapter_off_the_wrapped_model_is_the_base(model_dir, wrapped):
    ids = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    base_logprobs, _ = ScoringModel(load(model_dir).eval())(ids, mask, with_entropy=False)
    scorer = ScoringModel(wrapped.eval())
    with torch.no_grad(), wrapped.disable_adapter():
        off, _ = scorer(ids, mask, with_entropy=False)
    on, _ = scorer(ids, mask, with_entropy=False)
    assert torch.equal(off, base_logprobs)
    assert (on - base_logprobs).abs().max() > 1e-3  # the adapters do change the policy


def test_the_adapter_state_dict_holds_what_trains_and_loads_only_that(model_dir, wrapped):
    scorer = AdapterScoringModel(wrapped)
    state = scorer.state_dict()
    trained = {name for name, p in scorer.named_parameters() if p.requires_grad}
    assert set(state) == trained  # no frozen base weight, not even the tied head's alias
    adapters_only = {k: v.clone() for k, v in state.items()}
    scorer.load_state_dict(adapters_only)
    with pytest.raises(RuntimeError, match="not this run's LoRA adapter"):
        scorer.load_state_dict({k: v for k, v in list(adapters_only.items())[1:]})
    with pytest.raises(RuntimeError, match="not this run's LoRA adapter"):
        scorer.load_state_dict(load(model_dir).state_dict())  # a full fine-tuning checkpoint


def test_a_model_without_adapters_comes_out_as_it_is_and_is_never_handed_out(model_dir):
    model = load(model_dir)
    plain = model.state_dict()
    weights = list(merged_weights(model, torch.float32, skip=frozenset({"lm_head.weight"})))
    assert [name for name, _ in weights] == [name for name in plain if name != "lm_head.weight"]
    assert all(torch.equal(tensor, plain[name]) for name, tensor in weights)
    parameters = {id(p) for p in model.parameters()}
    assert not any(id(tensor) in parameters or tensor.requires_grad for _, tensor in weights)  # detached copies
