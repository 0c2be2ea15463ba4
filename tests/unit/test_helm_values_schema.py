"""The chart's values.schema.json refuses keys the chart does not read (issue 47, item 2).

Before: `--set rollout.gpuPerReplica=1` (for gpusPerReplica) rendered, and the rollout workers asked for no GPU. Helm
checks values against the schema on install, upgrade, template and lint; here the chart renders in-process
(helm-python-sdk, as in test_helm_chart.py), which runs the same check. The values the repository ships — the
chart's values.yaml and the `helm install` commands in the docs — must still pass.
"""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.unit.test_helm_chart import CHART, CUSTOM_VALUES, LEARNER_ON, render

DOCS_WITH_INSTALLS = [REPO_ROOT / "docs" / "deployment.md", REPO_ROOT / "deploy" / "README.md"]


def refused_key(values: dict) -> str:
    """Helm's message for `values`, which the chart must refuse."""
    from helm_python.errors import HelmValuesError

    with pytest.raises(HelmValuesError) as err:
        render(values)
    return str(err.value)


@pytest.mark.parametrize(
    ("values", "path", "key"),
    [
        ({"rollout": {"gpuPerReplica": 1}}, "/rollout", "gpuPerReplica"),
        ({"learnr": {"enabled": True}}, "", "learnr"),
        ({"rollout": {"worker": {"memmory": "64Gi"}}}, "/rollout/worker", "memmory"),
        ({"learner": {"checkpoints": {"persistence": {"sise": "1Ti"}}}}, "/learner/checkpoints/persistence", "sise"),
        ({"verifier": {"resources": {"limit": {"memory": "1Gi"}}}}, "/verifier/resources", "limit"),
        ({"redis": {"resources": {"cpus": "2"}}}, "/redis/resources", "cpus"),
    ],
)
def test_a_misspelt_key_is_refused_naming_it_and_where(values, path, key):
    message = refused_key(values)
    assert f"at '{path}'" in message and f"'{key}'" in message, message


def test_a_gpu_request_is_not_lost_to_a_typo():
    """What the typo cost: the workers asked for no GPU. The spelling the chart reads still gets one."""
    refused_key({"rollout": {"gpuPerReplica": 1}})
    [service] = [d for d in render({"rollout": {"gpusPerReplica": 1}}) if d["kind"] == "RayService"]
    [group] = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    [worker] = group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] in (1, "1")


def test_enabled_switches_must_be_booleans():
    """`enabled: "false"` (a string) is true to a template."""
    assert "boolean" in refused_key({"learner": {"enabled": "false"}}).lower()


def test_service_configs_and_kubernetes_objects_pass_through():
    """Keys that are not the chart's: each service checks its own config, Kubernetes its objects."""
    render(
        {
            "learner": {**LEARNER_ON, "config": {"lora": {"rank": 8}}},
            "verifier": {"config": {"num_workers": 4}, "resources": {"limits": {"cpu": "4", "memory": "8Gi"}}},
            "nodeSelector": {"example.com/any-label": "x"},
            "podSecurityContext": {"runAsNonRoot": True, "supplementalGroups": [5]},
            "monitoring": {"grafanaDashboard": {"labels": {"any": "label"}}},
        }
    )


def test_every_key_values_yaml_sets_is_in_the_schema():
    """values.yaml is the chart's documentation of its keys: the schema and it name the same ones."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def strict_keys(node: dict, value: dict, path: str):
        if node.get("additionalProperties") is False:
            assert set(node["properties"]) - {"global"} == set(value), path
            for key, child in value.items():
                if isinstance(child, dict):
                    yield from strict_keys(node["properties"][key], child, f"{path}.{key}")
            yield path

    assert len(list(strict_keys(schema, values, ""))) >= 20  # every level a user sets, not a loose top


def documented_installs() -> list[tuple[str, dict]]:
    """The values of each `helm install` command in the docs (`--set a.b=v`, `{x}` lists as Helm reads them)."""
    installs = []
    for doc in DOCS_WITH_INSTALLS:
        lines = iter(doc.read_text().splitlines())
        for line in lines:
            if not line.startswith("helm install "):
                continue
            command = line
            while command.rstrip().endswith("\\"):
                command = command.rstrip()[:-1] + " " + next(lines)
            words = shlex.split(command, comments=True)
            values: dict = {}
            for flag, setting in zip(words, words[1:], strict=False):
                if flag == "--set":
                    dotted, raw = setting.split("=", 1)
                    *parents, leaf = dotted.split(".")
                    node = values
                    for part in parents:
                        node = node.setdefault(part, {})
                    node[leaf] = raw[1:-1].split(",") if raw.startswith("{") else yaml.safe_load(raw)
            installs.append((f"{doc.name}: {line}", values))
    return installs


def test_the_documented_installs_and_the_chart_tests_values_pass():
    installs = documented_installs()
    assert len(installs) == 2 and all(values for _, values in installs), installs
    for where, values in installs:
        assert render(values), where
    render(CUSTOM_VALUES)
