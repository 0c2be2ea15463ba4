"""Where a learner process runs and what it runs with: its device among those it sees, the Adam it gets, and the
GPUs it asks Ray for (pure logic; the CUDA paths themselves are in tests/gpu/)."""

from __future__ import annotations

import pytest

from rlep.services.learner.config import TrainConfig
from rlep.services.learner.deepspeed_setup import choose_adam, deepspeed_config, local_device_index


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
        ("auto", True, False, False, "torch_fused"),  # no prebuilt op, no nvcc: no build at start
        ("auto", True, True, True, "deepspeed_cpu"),
        ("auto", False, True, False, "torch_fused"),
        ("torch", True, False, True, "torch_fused"),
        ("deepspeed", True, True, True, "deepspeed_cpu"),
    ],
)
def test_adam_choice(preference, cuda, offload, ready, expected):
    asked = []

    def op_ready(name: str) -> bool:
        asked.append(name)
        return ready

    assert choose_adam(preference, cuda, offload, op_ready) == expected
    if expected.startswith("deepspeed"):
        assert asked == ["CPUAdamBuilder" if offload else "FusedAdamBuilder"]


def test_adam_deepspeed_without_its_op_fails_naming_the_op():
    with pytest.raises(RuntimeError, match="FusedAdamBuilder"):
        choose_adam("deepspeed", True, False, lambda name: False)
    with pytest.raises(ValueError, match="needs CUDA or optimizer offload"):
        choose_adam("deepspeed", False, False, lambda name: True)


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
