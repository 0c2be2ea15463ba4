"""A trained checkpoint's policy version reaches the rollout started from it: `rlep-policy.json` beside the HF
export (rlep.common.policy_info), read by the stack that starts replicas from the checkpoint and by a push of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlep.common.policy_info import POLICY_FILE, policy_version_of, write_policy_info


def started_rollout_config(monkeypatch, model_dir: Path):
    """The RolloutConfig `ServiceStack._start_rollout` hands to Ray Serve for `model_dir` (Serve itself stubbed)."""
    from ray import serve

    import rlep.services.rollout.ray_app as ray_app
    import rlep.services.rollout.registry as registry
    from rlep.services.launch.stack import ServiceStack
    from rlep.services.learner.config import TrainConfig

    built = []
    monkeypatch.setattr(serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(serve, "run", lambda app, **kwargs: None)
    monkeypatch.setattr(ray_app, "build_app", lambda config, *args: built.append(config))
    monkeypatch.setattr(registry, "replica_addresses", lambda *args, **kwargs: ["127.0.0.1:1"])
    ServiceStack(TrainConfig(), model_dir)._start_rollout({}, 0.0)
    (config,) = built
    assert config.engine.model == str(model_dir)
    return config


def test_a_rollout_started_from_a_trained_checkpoint_serves_its_version(monkeypatch, tmp_path):
    base, trained = tmp_path / "base", tmp_path / "step_40" / "hf"
    base.mkdir()
    write_policy_info(trained, "run", 40, 41)
    assert started_rollout_config(monkeypatch, trained).initial_version == 41
    assert started_rollout_config(monkeypatch, base).initial_version == 0  # a base model records none


class Replicas:
    def __init__(self, served: int):
        self.served, self.pushed = served, []

    def versions(self) -> list[int]:
        return [self.served]

    def push_weights(self, state, version) -> None:
        self.pushed.append(version)


def test_a_pushed_checkpoint_keeps_its_version_unless_the_replicas_are_past_it(tmp_path):
    import torch
    from safetensors.torch import save_file

    from rlep.services.learner.collect import push_checkpoint

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    write_policy_info(tmp_path, "run", 40, 41)
    assert push_checkpoint(fresh := Replicas(0), tmp_path) == 41 and fresh.pushed == [41]
    assert push_checkpoint(Replicas(41), tmp_path) == 42  # versions only grow on a replica
    (tmp_path / POLICY_FILE).unlink()
    assert push_checkpoint(Replicas(3), tmp_path) == 4


def test_policy_file_round_trip_and_errors(tmp_path):
    assert policy_version_of(tmp_path) == 0
    write_policy_info(tmp_path, "run", 12, 13)
    assert policy_version_of(tmp_path) == 13
    (tmp_path / POLICY_FILE).write_text("{}")
    with pytest.raises(ValueError, match="not an RLEP policy file"):
        policy_version_of(tmp_path)
