"""The Helm chart renders (in-process, helm-python-sdk) and every manifest validates against Kubernetes' schemas.

RayService and ServiceMonitor are CRDs that kubernetes-validate has no schema for; their structure is
checked here instead, and the configs the chart writes are parsed by the services' own config classes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT

CHART = REPO_ROOT / "deploy" / "helm" / "rlep"
KUBE_VERSION = "1.32.0"
CRD_KINDS = {"RayService", "ServiceMonitor"}
TOKEN_PATH = "/etc/rlep/secrets/auth-token"

# What the learner needs to train: parquet files on a data volume.
LEARNER_ON = {
    "enabled": True,
    "trainFiles": ["train.parquet"],
    "dataVolume": {"persistentVolumeClaim": {"claimName": "data"}},
}

# Everything a production install changes: GPUs, a model volume, sizes, placement, external Redis, monitoring on.
CUSTOM_VALUES = {
    "image": {"repository": "registry.example/rlep", "tag": "1.2.3"},
    "model": {"volume": {"persistentVolumeClaim": {"claimName": "qwen"}}, "path": "qwen-7b"},
    "auth": {"token": "t0ken"},
    "redis": {"enabled": False, "externalUrl": "redis://:pw@redis.example:6379/0"},
    "verifier": {"replicas": 3, "config": {"num_workers": 8, "item_timeout_s": 10.0}},
    "replay": {"replicas": 2},
    "eval": {"rolloutEndpoints": ["10.0.0.5:50063"], "dataVolume": {"persistentVolumeClaim": {"claimName": "data"}}},
    "rollout": {
        "replicas": 4,
        "gpusPerReplica": 1,
        "cpusPerReplica": 8,
        "config": {"engine": {"dtype": "bfloat16"}},
        "head": {"env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]},
        "worker": {
            "memory": "64Gi",
            "shmSize": "20Gi",
            "weightPushSize": "16Gi",
            "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "volumeMounts": [{"name": "cache", "mountPath": "/home/rlep/.cache"}],
            "nodeSelector": {"nvidia.com/gpu.product": "H100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
    "learner": {
        **LEARNER_ON,
        "processes": 4,
        "gpusPerProcess": 1,
        "config": {"run_id": "qwen-rlep", "steps": 500, "algorithm": {"replayed_per_question": 2}},
        "checkpoints": {"persistence": {"enabled": True, "storageClass": "fast"}},
        "resources": {"cpu": "16", "memory": "256Gi"},
        "shmSize": "64Gi",
    },
    "nodeSelector": {"pool": "rlep"},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus"}}},
}


def render(values: dict | None = None) -> list[dict]:
    import helm_python

    rendered = helm_python.Chart.load(str(CHART)).render(values or {}, name="rlep", namespace="ml")
    # NOTES.txt is rendered too: it is text for the user, not a manifest.
    docs = [doc for path, text in rendered.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    assert docs, "the chart rendered nothing"
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def learner_job(docs: list[dict]) -> dict:
    """The learner Job (its name carries a hash of its spec: rlep-learner-<8 hex>)."""
    [job] = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].startswith("rlep-learner-")]
    return job


@pytest.fixture(scope="module", params=["default", "custom"])
def manifests(request) -> list[dict]:
    return render({} if request.param == "default" else CUSTOM_VALUES)


def test_lint_is_clean():
    import helm_python

    report = helm_python.chart.lint(str(CHART), strict=True)
    assert not report.get("errors"), report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


def test_every_manifest_validates_against_the_kubernetes_schema(manifests):
    import kubernetes_validate

    for doc in manifests:
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, err.path))}: {err.message}")


def test_default_install_has_every_component(manifests):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in manifests}
    for component in ("verifier", "replay", "eval"):
        assert ("Deployment", f"rlep-{component}") in kinds and ("Service", f"rlep-{component}") in kinds
    assert ("RayService", "rlep-rollout") in kinds and ("ConfigMap", "rlep-dashboard") in kinds
    learner_on = any(d["kind"] == "Job" for d in manifests)
    assert learner_on == ("train.yaml" in by_kind(manifests, "ConfigMap")["rlep-config"]["data"])


def test_default_install_leaves_the_learner_off_until_it_has_data():
    import helm_python

    assert "Job" not in {d["kind"] for d in render()}, "the learner needs training data to run"
    with pytest.raises(helm_python.HelmError, match="learner.enabled needs training data"):
        render({"learner": {"enabled": True}})
    with pytest.raises(helm_python.HelmError, match="learner.dataVolume is empty"):
        render({"learner": {"enabled": True, "trainFiles": ["a.parquet"]}})


def test_services_select_pods_the_chart_creates(manifests):
    pod_labels = [t["metadata"]["labels"] for t in pod_templates(manifests)]
    for name, service in by_kind(manifests, "Service").items():
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), f"Service {name} selects no pod"
        for port in service["spec"]["ports"]:
            if isinstance(port["targetPort"], str):
                named = {
                    p["name"]
                    for t in pod_templates(manifests)
                    if selector.items() <= t["metadata"]["labels"].items()
                    for c in t["spec"]["containers"]
                    for p in c.get("ports", [])
                }
                assert port["targetPort"] in named, f"Service {name}: no container port {port['targetPort']!r}"


def test_deployments_probe_grpc_health_or_http_healthz(manifests):
    deployments = by_kind(manifests, "Deployment")
    health_ports = {"rlep-verifier": 50071, "rlep-replay": 50072}  # server.health_port, beside 50061 / 50062
    for name, port in health_ports.items():
        [container] = deployments[name]["spec"]["template"]["spec"]["containers"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (name, probe)
        assert "--config=/etc/rlep/config/" + name.removeprefix("rlep-") + ".yaml" in container["command"]
    [eval_container] = deployments["rlep-eval"]["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert eval_container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}


def test_referenced_configmaps_and_secrets_exist(manifests):
    configmaps, secrets = set(by_kind(manifests, "ConfigMap")), set(by_kind(manifests, "Secret"))
    for template in pod_templates(manifests):
        for volume in template["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
        for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets and ref["key"] in by_kind(manifests, "Secret")[ref["name"]]["data"]


def test_service_configs_parse_with_the_services_own_classes(manifests, tmp_path):
    from rlep.services.eval.config import EvalConfig
    from rlep.services.learner.config import TrainConfig
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.verifier.config import VerifierConfig

    files = by_kind(manifests, "ConfigMap")["rlep-config"]["data"]
    token = tmp_path / "token"
    token.write_text("x\n")
    # Mounted as rendered: the replicas come from DNS at run time, nothing is filled in at pod start.
    parsed = {
        "verifier": VerifierConfig.model_validate(local(files["verifier.yaml"], token)),
        "replay": ReplayConfig.model_validate(local(files["replay.yaml"], token)),
        "eval": EvalConfig.model_validate(local(files["eval.yaml"], token)),
    }
    if "train.yaml" in files:
        parsed["train"] = TrainConfig.model_validate(local(files["train.yaml"], token))
    assert parsed["verifier"].server.host == "0.0.0.0" and parsed["verifier"].server.port == 50061
    assert parsed["replay"].server.metrics_port == 9462
    assert parsed["eval"].verifier.address == "rlep-verifier:50061"
    [eval_container] = by_kind(manifests, "Deployment")["rlep-eval"]["spec"]["template"]["spec"]["containers"]
    if "/data" in {m["mountPath"] for m in eval_container.get("volumeMounts", [])}:
        assert parsed["eval"].allowed_roots == [Path("/data")], "eval must accept files on its data volume"
    else:
        assert "allowed_roots" not in files["eval.yaml"]
    if "train" in parsed:
        train = parsed["train"]
        assert train.endpoints.replay == "rlep-replay:50062" and train.metrics_port == 9464
        assert train.metrics_host == "0.0.0.0" and str(train.checkpoint.dir) == f"/checkpoints/{train.run_id}"


def test_rayservice_deploys_the_rollout_app_builder(manifests, tmp_path):
    from ray.serve.schema import ServeDeploySchema

    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.ray_app import app_builder

    [service] = by_kind(manifests, "RayService").values()
    assert service["apiVersion"] == "ray.io/v1"
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    [app] = serve_config.applications
    assert app.import_path == "rlep.services.rollout.ray_app:app_builder"
    token = tmp_path / "token"
    token.write_text("x\n")
    config = local(yaml.safe_dump(app.args["config"]), token)
    # Build the application from the rendered args, as `serve deploy` does (binding it needs no cluster).
    deployment = app_builder({**app.args, "config": config})._bound_deployment
    assert deployment.num_replicas == app.args["num_replicas"]
    assert deployment.ray_actor_options["num_cpus"] == float(app.args["num_cpus"])
    assert deployment.init_args[1] == app.args["app_name"] == app.name
    # One replica per worker pod, on the fixed port the pod declares (the NetworkPolicy names it).
    assert deployment.init_args[2:] == (app.args["port"], 1) and app.args["port"] > 0
    assert RolloutConfig.model_validate(deployment.init_args[0]).server.metrics_port == 9463
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    [workers] = cluster["workerGroupSpecs"]
    assert workers["replicas"] == app.args["num_replicas"] == app.deployments[0].num_replicas
    [worker] = workers["template"]["spec"]["containers"]
    assert {"containerPort": 9463, "name": "metrics"} in worker["ports"]
    assert {"containerPort": app.args["port"], "name": "grpc"} in worker["ports"]


def test_custom_values_reach_the_manifests():
    docs = render(CUSTOM_VALUES)
    [rayservice] = by_kind(docs, "RayService").values()
    [workers] = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = workers["template"]["spec"]
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["containers"][0]["image"] == "registry.example/rlep:1.2.3-gpu"
    assert spec["nodeSelector"] == {"pool": "rlep", "nvidia.com/gpu.product": "H100"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    [app] = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    assert app["deployments"][0]["ray_actor_options"] == {"num_cpus": 8, "num_gpus": 1}
    assert app["args"]["config"]["engine"] == {"model": "/models/qwen-7b", "dtype": "bfloat16"}
    assert by_kind(docs, "Deployment")["rlep-verifier"]["spec"]["replicas"] == 3

    job = learner_job(docs)["spec"]["template"]["spec"]
    assert job["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert job["initContainers"][0]["name"] == "wait-rollout"
    train = yaml.safe_load(by_kind(docs, "ConfigMap")["rlep-config"]["data"]["train.yaml"])
    assert train["deepspeed"]["num_processes"] == 4 and train["steps"] == 500

    assert "StatefulSet" not in {d["kind"] for d in docs}, "redis.enabled=false still rendered Redis"
    secret = by_kind(docs, "Secret")["rlep-secrets"]["data"]
    assert b64(secret["redis-url"]) == "redis://:pw@redis.example:6379/0" and b64(secret["auth-token"]) == "t0ken"
    eval_spec = by_kind(docs, "Deployment")["rlep-eval"]["spec"]["template"]["spec"]
    assert "initContainers" not in eval_spec, "explicit eval.rolloutEndpoints still wait for the RayService"
    assert eval_spec["containers"][0]["command"][-1] == "--config=/etc/rlep/config/eval.yaml"


def test_default_redis_is_a_persistent_aof_statefulset_behind_a_password():
    docs = render()
    [redis] = by_kind(docs, "StatefulSet").values()
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    [container] = redis["spec"]["template"]["spec"]["containers"]
    assert "--appendfsync always" in container["args"][0] and '--requirepass "$REDIS_PASSWORD"' in container["args"][0]
    secret = by_kind(docs, "Secret")["rlep-secrets"]["data"]
    password = b64(secret["redis-password"])
    assert len(password) == 32 and b64(secret["redis-url"]) == f"redis://:{password}@rlep-redis:6379/0"
    assert len(b64(secret["auth-token"])) == 48


def test_servicemonitor_scrapes_labelled_services_with_the_token():
    docs = render(CUSTOM_VALUES)
    [monitor] = by_kind(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in by_kind(docs, "Service").values() if selector.items() <= s["metadata"]["labels"].items()]
    ports = {p["name"] for s in scraped for p in s["spec"]["ports"]}
    endpoints = monitor["spec"]["endpoints"]
    assert {e["port"] for e in endpoints} <= ports
    names = {s["metadata"]["name"] for s in scraped}
    assert names == {"rlep-verifier", "rlep-replay", "rlep-eval", "rlep-rollout-metrics", "rlep-learner"}
    for endpoint in endpoints:
        credentials = endpoint["authorization"]["credentials"]
        assert endpoint["path"] == "/metrics" and credentials == {"name": "rlep-secrets", "key": "auth-token"}
    assert "ServiceMonitor" not in {d["kind"] for d in render()}, "ServiceMonitor should be off by default"


def test_dashboard_configmap_is_the_shipped_dashboard():
    [configmap] = [d for d in render() if d["metadata"]["name"] == "rlep-dashboard"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((REPO_ROOT / "deploy/monitoring/grafana/rlep.json").read_text())
    assert json.loads(configmap["data"]["rlep.json"]) == shipped


def test_learner_init_container_waits_on_the_service_the_learner_resolves():
    docs = render({"learner": LEARNER_ON})
    job = learner_job(docs)["spec"]["template"]["spec"]
    [init] = job["initContainers"]
    train = yaml.safe_load(by_kind(docs, "ConfigMap")["rlep-config"]["data"]["train.yaml"])
    service = train["endpoints"]["rollout_service"]
    assert service == "rlep-rollout-replicas:50063"
    assert init["command"][:2] == ["python", "/etc/rlep/scripts/wait_rollout.py"]
    assert f"--service={service}" in init["command"] and f"--token-file={TOKEN_PATH}" in init["command"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts["auth-token"] == str(Path(TOKEN_PATH).parent) and "auth-token" in {v["name"] for v in job["volumes"]}
    [shell, flag, script] = job["containers"][0]["command"]
    assert (shell, flag) == ("sh", "-c") and "exec rlep train --config=/etc/rlep/config/train.yaml" in script
    assert "run='/checkpoints/rlep';" in script and '[ -e "$run/latest" ]' in script, "a retried pod must resume"
    scripts = by_kind(docs, "ConfigMap")["rlep-scripts"]["data"]["wait_rollout.py"]
    assert scripts.strip() == (CHART / "files" / "wait_rollout.py").read_text().strip()


def test_missing_redis_url_fails_with_a_clear_message():
    import helm_python

    with pytest.raises(helm_python.HelmError, match="set redis.externalUrl"):
        render({"redis": {"enabled": False}})


def pod_templates(docs: list[dict]) -> list[dict]:
    templates = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            templates.append(doc["spec"]["template"])
        elif doc["kind"] == "RayService":
            cluster = doc["spec"]["rayClusterConfig"]
            templates += [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    return templates


def local(text: str, token: Path) -> dict:
    """A rendered config with the in-pod token path pointed at a local file (the classes check it exists)."""
    return yaml.safe_load(text.replace(TOKEN_PATH, str(token)))


def b64(value: str) -> str:
    import base64

    return base64.b64decode(value).decode()


def load_wait_rollout():
    """files/wait_rollout.py, the init containers' start gate (a script in a ConfigMap, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("wait_rollout", CHART / "files" / "wait_rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_nccl_settings_reach_the_learner_and_the_rollout_workers_only_when_set():
    def broadcast_containers(docs):
        [service] = by_kind(docs, "RayService").values()
        workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
        [learner] = [c for c in learner_job(docs)["spec"]["template"]["spec"]["containers"] if c["name"] == "learner"]
        return [learner, *workers]

    nccl = {"nccl": {"socketIfname": "ens5", "debug": "INFO"}}
    for container in broadcast_containers(render({**CUSTOM_VALUES, **nccl})):
        assert _env(container) | {"NCCL_SOCKET_IFNAME": "ens5", "NCCL_DEBUG": "INFO"} == _env(container)
    for container in broadcast_containers(render(CUSTOM_VALUES)):
        assert not {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG"} & set(_env(container))


def test_the_tool_sandbox_is_opt_in_alone_unconfined_and_reached_by_the_learner_only(tmp_path):
    """Issue 50: off by default; on, it serves `rlep serve sandbox` with its config, its pod alone runs without the
    RuntimeDefault seccomp profile (bubblewrap needs user namespaces), the learner's endpoints name it, and only the
    learner may reach its gRPC port."""
    from rlep.services.learner.config import TrainConfig
    from rlep.services.sandbox.config import SandboxServiceConfig

    assert "rlep-sandbox" not in by_kind(render(), "Deployment")
    docs = render({"sandbox": {"enabled": True}, "learner": LEARNER_ON})
    deployments = by_kind(docs, "Deployment")
    pod = deployments["rlep-sandbox"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][:3] == ["rlep", "serve", "sandbox"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "Unconfined"} and pod["securityContext"]["runAsNonRoot"]
    others = {name: d["spec"]["template"]["spec"]["securityContext"] for name, d in deployments.items()}
    assert all(
        c["seccompProfile"] == {"type": "RuntimeDefault"} for name, c in others.items() if name != "rlep-sandbox"
    )
    files = by_kind(docs, "ConfigMap")["rlep-config"]["data"]
    token = tmp_path / "token"
    token.write_text("x\n")
    config = SandboxServiceConfig.model_validate(local(files["sandbox.yaml"], token))
    assert (config.server.port, config.server.metrics_port, config.sandbox.isolation) == (50064, 9465, "bubblewrap")
    assert TrainConfig.model_validate(local(files["train.yaml"], token)).endpoints.sandbox == "rlep-sandbox:50064"
    policy = by_kind(docs, "NetworkPolicy")["rlep-sandbox"]["spec"]["ingress"]
    grpc_rule = next(rule for rule in policy if {"protocol": "TCP", "port": 50064} in rule.get("ports", []))
    assert [f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in grpc_rule["from"]] == ["learner"]
