"""docker-compose.gpu.yml over docker-compose.yml, merged as compose merges them (Debian's `docker-compose config`,
no engine needed): the rollout and the learner each reserve a GPU of their own and run the GPU image, the learner
is told to need its GPU (and so refuses a container without one), the rollout's /dev/shm holds a 7B push, and
nothing else of the base file changes."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from rlep.common.config import load_config
from rlep.services.learner.config import TrainConfig
from tests.conftest import REPO_ROOT
from tests.unit.test_deploy_compose import COMPOSE_FILE, overrides

GPU_FILE = REPO_ROOT / "docker-compose.gpu.yml"
GPU_SERVICES = ("rollout", "learner")
# The keys the override may set; every other key of every service is the base file's.
OVERRIDDEN = {"image", "build", "deploy", "shm_size", "environment"}
# One push of Qwen2.5-Math-7B in bf16 (docs/scaling.md §1, `S`) plus its ~34 KB safetensors header.
PUSH_7B_BYTES = 15_231_233_024 + 34_000


def compose_config(*files) -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose not found: install Debian's `docker-compose` package (scripts/system-deps.sh)")
    args = [arg for file in files for arg in ("-f", str(file))]
    result = subprocess.run([binary, *args, "config"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def base() -> dict:
    return compose_config(COMPOSE_FILE)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return compose_config(COMPOSE_FILE, GPU_FILE)


def gpu_ids(service: dict) -> list[str]:
    """Device ids of the service's NVIDIA GPU reservations ([] when it reserves none)."""
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
    return [i for d in gpus for i in d.get("device_ids", [])]


def unordered(key: str, value):
    """Compose merges some lists as sets (a service's secrets and security options come back reordered): compare
    those as sets."""
    return sorted(map(repr, value)) if key in ("secrets", "volumes", "ports", "security_opt") and value else value


def docker_bytes(size: str) -> int:
    """Docker's size units are binary: 4gb = 4 GiB."""
    number, unit = re.fullmatch(r"(\d+)([kmg]?)b?", size.lower()).groups()
    return int(number) * 1024 ** " kmg".index(unit or " ")


def test_the_rollout_and_the_learner_reserve_a_gpu_each_and_run_the_gpu_image(base, gpu):
    services = gpu["services"]
    rollout, learner = gpu_ids(services["rollout"]), gpu_ids(services["learner"])
    assert rollout and learner, "a GPU service reserves no GPU"
    # Docker hands every `count: 1` container the first GPU: each service names distinct ones.
    assert not set(rollout) & set(learner), (rollout, learner)
    for name in GPU_SERVICES:
        assert services[name]["image"] != base["services"][name]["image"], f"{name} runs the CPU image"
    assert services["rollout"]["build"]["dockerfile"] == "deploy/docker/Dockerfile.gpu"
    for name in set(services) - set(GPU_SERVICES):
        assert gpu_ids(services[name]) == [], name
    assert all(gpu_ids(service) == [] for service in base["services"].values())


def test_the_override_changes_nothing_else_of_the_base_file(base, gpu):
    assert set(gpu["services"]) == set(base["services"])
    for name, service in base["services"].items():
        merged = gpu["services"][name]
        keys = (set(service) | set(merged)) - (OVERRIDDEN if name in GPU_SERVICES else set())
        assert {k: unordered(k, merged.get(k)) for k in keys} == {k: unordered(k, service.get(k)) for k in keys}, name
        # Environment is merged key by key: the base file's values stay.
        assert service.get("environment", {}).items() <= merged.get("environment", {}).items(), name


def test_the_learner_is_told_to_need_its_gpus_and_refuses_a_container_without_one(gpu):
    """The learner's config as `rlep train` in the container builds it: the train file, the compose environment
    (RLEP_TRAIN__*) and the command's --set overrides."""
    from rlep.services.learner.ray_policy import check_gpus_fit

    learner = gpu["services"]["learner"]
    sets = [f"{path}={value}" for path, value in overrides(learner).items()]
    config = load_config(
        TrainConfig, REPO_ROOT / "configs" / "train.yaml", env_prefix="train", sets=sets, environ=learner["environment"]
    )
    assert config.local.learner_gpus == 1
    assert config.deepspeed.num_processes == len(gpu_ids(learner)), "one learner process per reserved GPU"
    check_gpus_fit(config.local, config.deepspeed.num_processes, cluster_gpus=1.0, start_rollout=False)
    with pytest.raises(ValueError, match="ask for GPUs, and the Ray cluster has none"):
        check_gpus_fit(config.local, config.deepspeed.num_processes, cluster_gpus=0.0, start_rollout=False)


def test_the_rollouts_shared_memory_holds_a_7b_push(base, gpu):
    shm = docker_bytes(gpu["services"]["rollout"]["shm_size"])
    assert shm >= PUSH_7B_BYTES, f"{shm:,} B of /dev/shm cannot stage a 7B bf16 push of {PUSH_7B_BYTES:,} B"
    assert docker_bytes(base["services"]["rollout"]["shm_size"]) < PUSH_7B_BYTES  # the CPU file: docs say so
