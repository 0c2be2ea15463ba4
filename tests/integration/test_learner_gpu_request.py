"""`RayPolicy` told to need GPUs (`local.learner_gpus: 1`, what docker-compose.gpu.yml sets) refuses to start where
it would train on the CPU, on a real Ray: a cluster with no GPU (a container given none), and a cluster whose GPU
torch cannot use (a CPU build of torch; Ray is told it has one GPU, as it would count one on a GPU host)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rlep.services.learner.config import TrainConfig

pytestmark = [pytest.mark.integration]

ASKED = {"local": {"learner_gpus": 1}, "deepspeed": {"num_processes": 1}}


def test_a_learner_asked_for_a_gpu_on_a_cluster_with_none_refuses(ray_local, tmp_path):
    from rlep.services.learner.ray_policy import RayPolicy

    assert ray_local.cluster_resources().get("GPU", 0.0) == 0.0
    with pytest.raises(ValueError, match="ask for GPUs, and the Ray cluster has none"):
        RayPolicy(tmp_path, TrainConfig.model_validate(ASKED))


# A Ray of its own (it counts one GPU) in a child process: the suite's shared Ray has none. Loopback only, as
# `init_ray` starts it; the policy's model directory is never read, the process refuses before loading it.
GIVEN_A_GPU_TORCH_CANNOT_USE = textwrap.dedent(
    """
    import os, sys
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray, torch
    from ray._private import ray_constants
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.ray_policy import RayPolicy

    assert not torch.cuda.is_available()
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        RayPolicy(sys.argv[1], TrainConfig.model_validate({config!r}))
    except ray.exceptions.RayTaskError as err:
        print("REFUSED", err.cause)
    else:
        print("STARTED")
    finally:
        ray.shutdown()
    """
)


@pytest.mark.slow
def test_a_learner_given_a_gpu_that_torch_cannot_use_refuses(tmp_path):
    script = GIVEN_A_GPU_TORCH_CANNOT_USE.format(config=ASKED)
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300, check=True
    )
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("REFUSED") and "sees no CUDA device" in last, result.stdout + result.stderr
