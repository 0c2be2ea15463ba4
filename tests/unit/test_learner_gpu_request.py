"""A learner told to need GPUs (`local.learner_gpus` > 0) refuses to start where it would train on the CPU: a Ray
cluster that counts no GPU (a container given none), or GPUs Ray hands out that torch cannot use (a CPU build).
The defaults ask for no GPU on a CPU machine, so the CPU path keeps working. Pure logic; the real Ray paths are
in tests/integration/test_learner_gpu_request.py."""

from __future__ import annotations

import pytest

from rlep.services.learner.config import TrainConfig

pytest.importorskip("ray")

from rlep.services.learner.ray_policy import check_assigned_gpus, check_gpus_fit  # noqa: E402 - needs ray


def test_a_learner_asked_for_gpus_refuses_a_cluster_with_none_and_says_why():
    asked = TrainConfig.model_validate({"local": {"learner_gpus": 1}})
    with pytest.raises(ValueError, match=r"local\.learner_gpus=1 ask for GPUs, and the Ray cluster has none") as err:
        check_gpus_fit(asked.local, 1, cluster_gpus=0.0, start_rollout=False)
    assert "docker-compose.gpu.yml" in str(err.value) and "local.learner_gpus: 0" in str(err.value)


def test_rollout_gpus_asked_for_are_named_too():
    both = TrainConfig.model_validate({"local": {"learner_gpus": 1, "rollout_gpus": 1}})
    with pytest.raises(ValueError, match=r"local\.rollout_gpus=1 and local\.learner_gpus=1 ask for GPUs"):
        check_gpus_fit(both.local, 1, cluster_gpus=0.0, start_rollout=True)


def test_the_defaults_and_an_explicit_zero_train_on_the_cpu():
    check_gpus_fit(TrainConfig().local, 1, cluster_gpus=0.0, start_rollout=True)
    cpu = TrainConfig.model_validate({"local": {"learner_gpus": 0}})
    check_gpus_fit(cpu.local, 2, cluster_gpus=0.0, start_rollout=False)


def test_a_learner_process_given_a_gpu_that_torch_cannot_use_refuses():
    with pytest.raises(RuntimeError, match=r"GPU\(s\) \[0\] but torch 2.13.0\+cpu sees no CUDA device"):
        check_assigned_gpus([0], cuda_available=False, torch_version="2.13.0+cpu")
    check_assigned_gpus([], cuda_available=False, torch_version="2.13.0+cpu")  # the CPU path
    check_assigned_gpus([0], cuda_available=True, torch_version="2.11.0+cu130")
