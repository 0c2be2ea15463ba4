"""A replica of a real pretrained model says in one line what dtype it runs and what it cast, instead of a warning per
tensor (issue 32, item 7). Before: starting SmolLM2-135M (float32 checkpoint, bfloat16 engine) printed 122
`Attempted to load weight … torch.float32 into parameter with dtype torch.bfloat16` lines, and every push printed
`RotaryEmbedding: Failed to load weights` and `ParallelLMHead: Failed to load weights` while it worked."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlep.services.learner.collect import push_checkpoint
from rlep.services.learner.weight_push import WeightPusher, push_dtype
from rlep.services.rollout.client import RolloutClient
from rlep.services.weights.config import AutoSyncConfig
from tests.service_process import ROLLOUT_STARTUP_TIMEOUT_S, start_service

pytestmark = pytest.mark.integration


def test_a_bfloat16_replica_of_a_float32_checkpoint_says_so_once_and_pushes_quietly(smollm2_dir, tmp_path):
    sets = [f"engine.model={smollm2_dir}", "engine.enforce_eager=true", "engine.max_model_len=512"]
    worker = start_service("rollout", tmp_path / "rollout.out", sets=sets, timeout_s=ROLLOUT_STARTUP_TIMEOUT_S)
    try:
        client = RolloutClient([worker.address])
        [status] = client.status()
        assert status.dtype == "bfloat16"  # vLLM's `auto` downcasts a float32 checkpoint
        assert push_checkpoint(client, smollm2_dir) == 1  # a push of the float32 file, cast again on load
        # The learner's push: cast to the engine's dtype before it is sent (half the bytes), loaded as it is.
        target = client.target()
        assert target.dtype == "bfloat16" and push_dtype(target, torch.float32) == torch.bfloat16
        state = load_file(str(smollm2_dir / "model.safetensors"))
        weights = {name: tensor.to(push_dtype(target, torch.float32)) for name, tensor in state.items()}
        pusher = WeightPusher()
        assert pusher.push(weights, target, 2, AutoSyncConfig()).updated == target.addresses
        pusher.close()
        assert client.versions() == [2]
        client.close()
    finally:
        output = worker.stop(timeout_s=120)
    assert worker.returncode == 0, output[-3000:]
    assert "Attempted to load weight" not in output
    assert "Failed to load weights" not in output
    [line] = [line for line in output.splitlines() if "rollout engine runs" in line]
    assert "rollout engine runs bfloat16; weights: weights (start): " in line
    assert "tensors cast float32->bfloat16" in line
    # One line for the float32 file's push; none for the push already in the engine's dtype.
    assert sum("weights (push of version 1): " in line for line in output.splitlines()) == 1
    assert "push of version 2" not in output
