"""LoRA on the policy (`lora.rank` > 0, docs/lora.md): the PEFT wrap, the merged weights that leave the learner,
the reference as the same module with its adapter switched off, and the adapter-only DeepSpeed checkpoint.

`apply_lora` wraps the loaded HF model with PEFT LoRA (adapters on `lora.target_modules`, every other weight
frozen); the policy hands DeepSpeed only the adapters' parameters, so the optimizer holds 12 B per adapter weight
and nothing for the base.

Whatever leaves the learner (pushes to rollout by any transport, the weight manifest, `state_dict`, the HF export)
is the plain model: `merged_weights` yields every tensor under the base model's own names, each adapted linear
weight as W + (alpha / r) B A computed in float32 beside the training weights (never merged into them), cast to the
caller's dtype. So rollout and `hf/` need no PEFT, and vLLM and transformers load the export as any checkpoint.

Under ZeRO-3 `merged_weights` gathers one layer's W, A and B at a time (`gather`). Not covered: adapters on
embeddings or convolutions, several adapters, pushing the adapter alone to vLLM (measured slower per step than
merged pushes: benchmarks/lora_push.py, docs/lora.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from rlep.services.learner.batch import ScoringModel
from rlep.services.learner.config import LoraConfig

# PEFT's adapter tensors in a wrapped model's state dict: not part of the merged, plain model.
ADAPTER_TENSORS = (".lora_A.", ".lora_B.", ".lora_embedding_", ".lora_magnitude_vector")
BASE_LAYER = ".base_layer."


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """`model` wrapped by PEFT with one LoRA adapter per `lora.target_modules` layer; only the adapters train.

    The adapters start as PEFT's default (A Kaiming-uniform from torch's generator, B = 0), so the wrapped model
    computes exactly what `model` did until the first update.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import Linear, LoraLayer

    if problem := target_problem(model, lora):
        raise ValueError(problem)
    settings = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=list(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, settings)
    others = [name for name, m in wrapped.named_modules() if isinstance(m, LoraLayer) and not isinstance(m, Linear)]
    if others:
        raise ValueError(f"lora.target_modules: only linear layers can take an adapter here, not {others[:3]}")
    return wrapped


def target_problem(model: torch.nn.Module, lora: LoraConfig) -> str | None:
    """What is wrong with `lora.target_modules` for `model`, or None: a name that matches no module (PEFT adapts
    the names that match and drops the others without a word; it fails only when none matches). Names match as
    PEFT matches them: a module's whole name, or its last dotted components."""
    names = [name for name, _ in model.named_modules()]
    unmatched = [t for t in lora.target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not unmatched:
        return None
    linear = dict.fromkeys(
        name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    )
    return (
        f"lora.target_modules: {', '.join(unmatched)} match{'es' * (len(unmatched) == 1)} no module of this model; "
        f"its linear layers are {', '.join(linear)}: name those"
    )


def model_skeleton(model_dir: str) -> torch.nn.Module:
    """The model of the HF checkpoint `model_dir` without its weights (on the meta device: no memory, no load), for
    checks of its module names before anything starts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a PEFT wrap (adapter layers included), or `model` itself when it is not wrapped."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


@torch.no_grad()
def merged_weights(
    model: torch.nn.Module,
    dtype: torch.dtype,
    skip: frozenset[str] = frozenset(),
    gather: Callable[[list[torch.nn.Parameter]], AbstractContextManager] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) of the plain model `model` stands for, in its state-dict order: a model without
    adapters as it is (the policy's one loop over weights, LoRA or not).

    Adapted linear weights come out as W + (alpha / r) B A, computed in float32 (W `[out, in]`, B `[out, r]`,
    A `[r, in]`); the training weights are not changed. Adapter tensors are left out, `.base_layer` dropped from
    names, and names in `skip` (a tied head) are not yielded.

    Args:
        gather: makes the listed parameters whole for the duration of a `with` (ZeRO-3's `GatheredParameters`):
            each yielded tensor is then valid only until the next one is asked for, and the caller copies it.
    """
    gather = gather or (lambda params: nullcontext())
    inner = base_model(model)
    layers = {}
    if inner is not model:  # PEFT-wrapped (importing peft costs seconds: not for full fine-tuning)
        from peft.tuners.lora import LoraLayer

        layers = {name: m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}
    params = dict(inner.named_parameters(remove_duplicate=False))  # a tied head under its own name too
    buffers = dict(inner.named_buffers())
    for name in inner.state_dict():  # names only: under ZeRO-3 the values are empty placeholders
        if any(marker in name for marker in ADAPTER_TENSORS):
            continue
        owner, through_base, leaf = name.partition(BASE_LAYER)
        plain = f"{owner}.{leaf}" if through_base else name
        if plain in skip:
            continue
        if name in buffers:
            yield plain, buffers[name].detach().to(dtype)
        elif through_base and leaf == "weight":
            layer = layers[owner]
            with gather([params[name], *adapter_parameters(layer)]):
                yield plain, (params[name].float() + adapter_delta(layer)).to(dtype)
        else:
            with gather([params[name]]):
                yield plain, params[name].detach().to(dtype)  # never the Parameter itself


def adapter_parameters(layer: Any) -> list[torch.nn.Parameter]:
    """The A and B weights of a PEFT LoRA linear layer's active adapters."""
    return [m[a].weight for m in (layer.lora_A, layer.lora_B) for a in layer.active_adapters]


def adapter_delta(layer: Any) -> torch.Tensor:
    """(alpha / r) B A of a PEFT LoRA linear layer's active adapters, float32, in its weight's `[out, in]` layout."""
    delta = torch.zeros(layer.base_layer.weight.shape, dtype=torch.float32, device=layer.base_layer.weight.device)
    for adapter in layer.active_adapters:
        update = layer.lora_B[adapter].weight.float() @ layer.lora_A[adapter].weight.float()
        delta += (update.T if layer.fan_in_fan_out else update) * layer.scaling[adapter]
    return delta


class AdapterScoringModel(ScoringModel):
    """`ScoringModel` over a PEFT-wrapped model, for DeepSpeed: its state dict holds what trains only (names as in
    `named_parameters`), so the DeepSpeed checkpoint holds the adapters and not the frozen base, a tied head's alias
    included (DeepSpeed's `exclude_frozen_parameters` alone misses it). Loading one requires every adapter weight
    and nothing else: the base comes from the starting checkpoint."""

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        state = torch.nn.Module.state_dict(self, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for name, param in self.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                state.pop(prefix + name, None)
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        trained = {name for name, p in self.named_parameters() if p.requires_grad}
        result = torch.nn.Module.load_state_dict(self, state_dict, strict=False, assign=assign)
        missing = sorted(trained & set(result.missing_keys))
        if missing or result.unexpected_keys:
            raise RuntimeError(
                "the checkpoint is not this run's LoRA adapter (same lora.rank and target_modules): "
                f"missing {missing[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}"
            )
        return result


class AdapterOff:
    """The KL term's reference under LoRA: the policy's own engine with its adapter switched off, which is the
    starting checkpoint (the base never trains), so no second copy of the model is loaded. Called like the
    reference module (`ScoringModel.forward`'s arguments)."""

    def __init__(self, engine: Any, model: torch.nn.Module):
        self.engine, self.model = engine, model

    def __call__(self, **inputs: Any):
        self.engine.eval()  # no adapter dropout; `update` puts it back in training mode
        with self.model.disable_adapter():
            return self.engine(**inputs)
