"""Run as a script by test_learner_zero3_loading.py: loads the model the way the learner does under ZeRO-`argv[2]`
in a one-process gloo group and prints, as JSON, whether every parameter came out partitioned and whether the
gathered weights equal the checkpoint's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlep.common.ports import free_port
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.deepspeed_setup import deepspeed_config, init_distributed, load_model


def main(model_dir: Path, stage: int) -> None:
    import deepspeed

    init_distributed(0, 1, "127.0.0.1", free_port())
    config = TrainConfig.model_validate({"deepspeed": {"zero_stage": stage}})
    model = load_model(model_dir, config.deepspeed, deepspeed_config(config.optim, config.deepspeed, 1))
    params = dict(model.named_parameters())
    partitioned = [hasattr(p, "ds_id") and p.data.numel() == 0 for p in params.values()]
    saved = load_file(model_dir / "model.safetensors")
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        equal = [torch.equal(params[name].detach().float(), tensor.float()) for name, tensor in saved.items()]
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    print(json.dumps({"partitioned": partitioned, "equal": equal, "zero3_left_on": is_deepspeed_zero3_enabled()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
