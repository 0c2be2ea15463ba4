"""Where a learner process runs and what it runs with: its device among those it sees, the Adam it gets, and the
GPUs it asks Ray for (pure logic; the CUDA paths themselves are in tests/gpu/)."""

from __future__ import annotations

import logging

import pytest

from rlep.services.learner.config import TrainConfig
from rlep.services.learner.deepspeed_setup import choose_adam, deepspeed_config, load_deepspeed_op, local_device_index


def test_a_ray_actor_drives_the_one_gpu_it_sees_whatever_its_rank():
    # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU: rank 3 sees one device, index 0 (not 3).
    assert local_device_index(rank=3, visible_devices=1, launcher_local_rank=None) == 0
    assert local_device_index(rank=0, visible_devices=0, launcher_local_rank=None) == 0  # CPU


def test_a_launcher_local_rank_wins_and_is_checked():
    assert local_device_index(rank=5, visible_devices=4, launcher_local_rank="1") == 1
    assert local_device_index(rank=5, visible_devices=4, launcher_local_rank=None) == 1  # shared node: rank % GPUs
    with pytest.raises(RuntimeError, match="local rank 2 but this process sees 1"):
        local_device_index(rank=2, visible_devices=1, launcher_local_rank="2")


@pytest.mark.parametrize(
    ("preference", "cuda", "offload", "ready", "expected"),
    [
        ("auto", False, False, True, "torch"),  # the CPU path: PyTorch's AdamW, as before
        ("auto", True, False, True, "deepspeed_fused"),
        ("auto", True, False, False, "torch_fused"),  # the op did not load: no DeepSpeed Adam
        ("auto", True, True, True, "deepspeed_cpu"),
        ("auto", False, True, False, "torch_fused"),
        ("torch", True, False, True, "torch_fused"),
        ("deepspeed", True, True, True, "deepspeed_cpu"),
    ],
)
def test_adam_choice(preference, cuda, offload, ready, expected):
    asked = []

    def load_op(name: str) -> None:
        asked.append(name)
        if not ready:
            raise RuntimeError("no op here")

    assert choose_adam(preference, cuda, offload, load_op) == expected
    if expected.startswith("deepspeed"):
        assert asked == ["CPUAdamBuilder" if offload else "FusedAdamBuilder"]


def test_adam_deepspeed_without_its_op_fails_naming_the_op_and_why():
    def fails(name: str) -> None:
        raise OSError("nvcc: not found")

    with pytest.raises(RuntimeError, match="FusedAdamBuilder op could not be loaded: OSError.*nvcc: not found"):
        choose_adam("deepspeed", True, False, fails)
    with pytest.raises(ValueError, match="needs CUDA or optimizer offload"):
        choose_adam("deepspeed", False, False, lambda name: None)


@pytest.fixture
def cpu_adam_builder():
    """The class of DeepSpeed's own CPU Adam builder on this machine (what optimizer offload asks for)."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    return type(get_accelerator().create_op_builder("CPUAdamBuilder"))


def test_an_op_that_fails_to_load_falls_back_to_torchs_fused_adam_with_a_warning(cpu_adam_builder, monkeypatch, caplog):
    """Here a compiler and ninja exist, so DeepSpeed would try a JIT build: when that build fails, `auto` must not
    pick the op anyway (the engine would fail at start) but fall back, saying why."""
    attempts = []

    def failing_load(self, verbose=False):
        attempts.append(self.name)
        raise RuntimeError("Error building extension 'cpu_adam'")

    monkeypatch.setattr(cpu_adam_builder, "load", failing_load)
    with caplog.at_level(logging.WARNING, logger="rlep.services.learner.deepspeed_setup"):
        assert choose_adam("auto", False, True, load_deepspeed_op) == "torch_fused"
    assert attempts == ["cpu_adam"]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "CPUAdamBuilder" in warned[0].getMessage()
    assert "Error building extension 'cpu_adam'" in warned[0].getMessage()
    with pytest.raises(RuntimeError, match="CPUAdamBuilder op could not be loaded.*Error building extension"):
        choose_adam("deepspeed", False, True, load_deepspeed_op)


def test_an_op_that_loads_is_used(cpu_adam_builder, monkeypatch):
    loaded = []
    monkeypatch.setattr(cpu_adam_builder, "load", lambda self, verbose=False: loaded.append(self.name))
    assert choose_adam("auto", False, True, load_deepspeed_op) == "deepspeed_cpu"
    assert loaded == ["cpu_adam"]


def test_torch_adams_reach_torch_through_deepspeeds_config():
    optim, ds = TrainConfig().optim, TrainConfig().deepspeed
    fused = deepspeed_config(optim, ds, 1, "torch_fused")["optimizer"]["params"]
    assert fused["torch_adam"] is True and fused["fused"] is True
    assert "fused" not in deepspeed_config(optim, ds, 1, "torch")["optimizer"]["params"]
    assert "torch_adam" not in deepspeed_config(optim, ds, 1, "deepspeed_fused")["optimizer"]["params"]


def test_learner_gpus_refuses_ranks_sharing_a_gpu():
    with pytest.raises(ValueError, match="Duplicate GPU"):
        TrainConfig.model_validate({"deepspeed": {"num_processes": 2}, "local": {"learner_gpus": 0.5}})
    with pytest.raises(ValueError, match="less than or equal to 1"):
        TrainConfig.model_validate({"local": {"learner_gpus": 2}})
    TrainConfig.model_validate({"deepspeed": {"num_processes": 1}, "local": {"learner_gpus": 0.5}})


def test_learner_gpus_follow_the_cluster():
    pytest.importorskip("ray")
    from rlep.services.learner.ray_policy import learner_gpus

    four = TrainConfig.model_validate({"deepspeed": {"num_processes": 4}})
    assert learner_gpus(four.local, cluster_gpus=8.0) == 1.0  # the driver may run on a CPU-only head node
    assert learner_gpus(TrainConfig().local, cluster_gpus=0.0) == 0.0
    assert learner_gpus(TrainConfig.model_validate({"local": {"learner_gpus": 0.5}}).local, cluster_gpus=8.0) == 0.5


def test_replicas_ask_for_their_tensor_parallel_gpus_and_a_run_that_does_not_fit_is_refused():
    pytest.importorskip("ray")
    from rlep.services.learner.ray_policy import check_gpus_fit, rollout_gpus

    paper = TrainConfig.model_validate(
        {
            "deepspeed": {"num_processes": 4},
            "local": {"rollout_replicas": 2, "rollout_engine": {"tensor_parallel_size": 2}},
        }
    )
    assert rollout_gpus(paper.local, cluster_gpus=8.0) == 2.0 and rollout_gpus(paper.local, cluster_gpus=0.0) == 0.0
    check_gpus_fit(paper.local, 4, cluster_gpus=8.0, start_rollout=True)  # 2 x 2 + 4 x 1: one 8-GPU node
    with pytest.raises(ValueError, match=r"needs 8 GPUs \(rollout 2 x 2, learner 4 x 1\) .* has 6"):
        check_gpus_fit(paper.local, 4, cluster_gpus=6.0, start_rollout=True)
    check_gpus_fit(paper.local, 4, cluster_gpus=6.0, start_rollout=False)  # replicas elsewhere: the learner's 4 fit
    with pytest.raises(ValueError, match=r"needs 4 GPUs \(learner 4 x 1\) .* has 2"):  # RayPolicy's own check
        check_gpus_fit(paper.local, 4, cluster_gpus=2.0, start_rollout=False)
    # CPUs only: nothing asked, nothing refused.
    check_gpus_fit(TrainConfig().local, 1, cluster_gpus=0.0, start_rollout=True)
