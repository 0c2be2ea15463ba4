"""Every container the Helm chart renders runs its own command inside the built image (`--dry-run` / `--help`),
with the chart's ConfigMaps, token and data volume mounted where the pod mounts them.

tests/unit/test_helm_cluster.py runs the same commands in the project's virtualenv; this shows the image has
the entry points, scripts and packages the pods call. It needs a Docker engine and `rlep:latest`
(deploy/docker/build-local.sh); otherwise it is skipped with the reason. The GPU image is not built here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.test_docker_smoke import why_not_runnable
from tests.unit.test_helm_chart import LEARNER_ON, by_kind, pod_templates, render

pytestmark = pytest.mark.integration
IMAGE = "rlep:latest"
# Ray head and worker containers get their command from KubeRay (`ray start`); they must import the Serve app.
RAY_NODE_CHECK = ["python", "-c", "import ray, rlep.services.rollout.ray_app as app; app.app_builder"]


def image_missing() -> str | None:
    if reason := why_not_runnable():
        return reason
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        return f"no {IMAGE} image: build it with deploy/docker/build-local.sh"
    return None


def mounts(spec: dict, container: dict, configmaps: dict, root: Path) -> list[str]:
    """`docker run` flags giving the container the pod's volumes: ConfigMaps' files, the token, /data; tmpfs else."""
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    flags = []
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})
        if "configMap" in volume:
            name = volume["configMap"]["name"]
            for key in configmaps[name].get("data") or {}:
                flags += ["-v", f"{root / name / key}:{mount['mountPath']}/{key}:ro"]
        elif "secret" in volume:
            for item in volume["secret"].get("items") or [{"path": "auth_token"}]:
                flags += ["-v", f"{root / 'token'}:{mount['mountPath']}/{item['path']}:ro"]
        elif mount["mountPath"] == "/data":
            flags += ["-v", f"{root / 'data'}:/data:ro"]
        else:
            flags += ["--tmpfs", f"{mount['mountPath']}:uid=1000,gid=1000"]
    return flags


def checked_command(container: dict) -> list[str]:
    command = container.get("command")
    if not command:
        return RAY_NODE_CHECK
    if command[0] == "sh":  # the learner's start-up script ends in `exec rlep train ... "$@"`
        return [*command, "sh", "--dry-run", "--skip-path-checks"]  # /models is an empty stand-in here
    return [*command, "--help" if command[0] == "python" else "--dry-run"]


def test_every_rendered_container_runs_its_command_in_the_image(tmp_path):
    if reason := image_missing():
        pytest.skip(f"chart commands in the image NOT run: {reason}")
    from rlep.services.demo.task import make_problems, write_parquet

    docs = render({"learner": LEARNER_ON})
    configmaps = by_kind(docs, "ConfigMap")
    for name, configmap in configmaps.items():
        for key, text in (configmap.get("data") or {}).items():
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / key).write_text(text)
    (tmp_path / "token").write_text("token\n")
    train = yaml.safe_load(configmaps["rlep-config"]["data"]["train.yaml"])
    for file in train["data"]["train_files"]:
        write_parquet(make_problems(8, 0, "train"), tmp_path / "data" / Path(file).relative_to("/data"))
    subprocess.run(["chmod", "-R", "a+rX", str(tmp_path)], check=True)

    ran = []
    for template in pod_templates(docs):
        spec = template["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            if not container["image"].startswith("rlep:"):
                continue  # Redis runs its own image
            argv = ["docker", "run", "--rm", "--entrypoint", "", *mounts(spec, container, configmaps, tmp_path)]
            result = subprocess.run(
                [*argv, IMAGE, *checked_command(container)], capture_output=True, text=True, timeout=300
            )
            assert result.returncode == 0, (container["name"], checked_command(container), result.stderr[-2000:])
            ran.append(container["name"])
    assert sorted(ran) == sorted(
        ["wait-rollout", "eval", "wait-rollout", "learner", "replay", "ray-head", "ray-worker", "verifier"]
    )
