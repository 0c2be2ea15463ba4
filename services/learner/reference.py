"""The reference policy of a KL term (`algorithm.kl_coef` > 0): the starting checkpoint, frozen.

Under LoRA it is not loaded: the policy with its adapter switched off is the starting checkpoint (lora.py,
`AdapterOff`). Otherwise it is loaded only when a KL term asks for it, in the training dtype, beside the policy
in each learner process.
Under ZeRO-3 it is partitioned like the policy (a DeepSpeed engine without an optimizer, as OpenRLHF's reference),
so no process holds the whole model; under ZeRO-0/1/2 each process holds a copy, as it does of the policy's
weights. Its logprobs are computed once per step, before the update, over the same micro-batches as the policy's
old logprobs (policy.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rlep.services.learner.batch import ScoringModel
from rlep.services.learner.config import DeepSpeedConfig
from rlep.services.learner.deepspeed_setup import load_model

log = logging.getLogger(__name__)


def load_reference(
    model_dir: Path, ds: DeepSpeedConfig, ds_config: dict[str, Any], device: torch.device, head_chunks: int = 1
):
    """The frozen reference as a module whose forward is `ScoringModel`'s (its head in `head_chunks` chunks, as the
    policy's): a DeepSpeed engine under ZeRO-3, else a plain module on `device`."""
    import deepspeed

    # Without gradient checkpointing or an optimizer: the reference never trains.
    frozen = ds.model_copy(update={"gradient_checkpointing": False})
    inference = {k: v for k, v in ds_config.items() if k not in ("optimizer", "gradient_clipping")}
    model = load_model(model_dir, frozen, inference)
    model.requires_grad_(False)
    scorer = ScoringModel(model, chunks=head_chunks).eval()
    if ds_config["zero_optimization"]["stage"] == 3:
        engine, *_ = deepspeed.initialize(model=scorer, config=inference)
        engine.eval()
        log.info("reference policy loaded from %s, partitioned (ZeRO-3)", model_dir)
        return engine
    log.info("reference policy loaded from %s on %s", model_dir, device)
    return scorer.to(device)
