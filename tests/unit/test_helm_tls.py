"""The Helm chart with `tls` on: servers get the certificate from the Secret, clients the CA, probes and the
ServiceMonitor still work, and every manifest still validates."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.test_helm_chart import KUBE_VERSION, LEARNER_ON, by_kind, pod_templates, render

TLS_VALUES = {"tls": {"secretName": "rlep-tls", "serverName": "rlep.internal"}, "auth": {"token": "t"}}
TLS_VALUES["monitoring"] = {"serviceMonitor": {"enabled": True}}
TLS_VALUES["learner"] = LEARNER_ON
TLS_DIR = "/etc/rlep/tls"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render(TLS_VALUES)


def test_tls_manifests_validate(docs):
    """Every manifest Kubernetes knows validates, and those are the TLS-shaped ones: each rlep workload validated
    mounts Secret `rlep-tls` read-only at the TLS directory (Redis speaks no TLS; Ray's CRDs are not validated)."""
    import kubernetes_validate

    workloads = {}
    for doc in docs:
        if doc["kind"] not in ("RayService", "ServiceMonitor"):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            if doc["kind"] in ("Deployment", "Job", "StatefulSet"):
                workloads[doc["metadata"]["name"].removeprefix("rlep-").split("-")[0]] = doc["spec"]["template"]
    assert sorted(workloads) == ["eval", "learner", "redis", "replay", "verifier"]
    for name, template in workloads.items():
        spec = template["spec"]
        tls_volumes = [v for v in spec.get("volumes", []) if v["name"] == "tls"]
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", []) if m["name"] == "tls"]
        if name == "redis":
            assert tls_volumes == [] and mounts == []
            continue
        assert tls_volumes == [{"name": "tls", "secret": {"secretName": "rlep-tls"}}], name
        assert mounts == [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}], name


def test_servers_read_the_certificate_the_pods_mount(docs, tmp_path):
    from rlep.common.config import ServerConfig

    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("pem")
    files = by_kind(docs, "ConfigMap")["rlep-config"]["data"]
    [rayservice] = by_kind(docs, "RayService").values()
    [app] = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    servers = {
        "verifier": yaml.safe_load(files["verifier.yaml"])["server"],
        "replay": yaml.safe_load(files["replay.yaml"])["server"],
        "rollout": app["args"]["config"]["server"],
        "eval": yaml.safe_load(files["eval.yaml"])["server"],
        "learner /metrics": yaml.safe_load(files["train.yaml"])["metrics_tls"],
    }
    for service, server in servers.items():
        assert (server["tls_cert_file"], server["tls_key_file"]) == (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key")
        local = {k: v.replace(TLS_DIR, str(tmp_path)) for k, v in server.items() if k.startswith("tls_")}
        assert ServerConfig(**local).read_tls_pair() == (b"pem", b"pem"), service


def test_every_rlep_container_mounts_the_secret_and_trusts_its_ca(docs):
    for template in pod_templates(docs):
        spec = template["spec"]
        if template["metadata"]["labels"].get("app.kubernetes.io/component") == "redis":
            continue
        assert {"name": "tls", "secret": {"secretName": "rlep-tls"}} in spec["volumes"]
        for container in spec["containers"] + spec.get("initContainers", []):
            assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in container["volumeMounts"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env["RLEP_TLS_CA_FILE"] == f"{TLS_DIR}/ca.crt", container["name"]
            assert env["RLEP_TLS_SERVER_NAME"] == "rlep.internal", container["name"]


def test_probes_and_scrapes_work_with_tls(docs):
    # The kubelet's gRPC probe cannot speak TLS: it probes the plaintext health port, not the TLS data port.
    [container] = by_kind(docs, "Deployment")["rlep-verifier"]["spec"]["template"]["spec"]["containers"]
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["rlep-config"]["data"]["verifier.yaml"])
    assert config["server"]["health_port"] == 50071 and config["server"]["port"] == 50061
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50071}, probe
    [monitor] = by_kind(docs, "ServiceMonitor").values()
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    assert set(endpoints) == {"metrics", "http"}  # learner and workers on `metrics`, eval on `http`
    for endpoint in endpoints.values():
        assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["serverName"] == "rlep.internal"
    learner_ports = [p["name"] for p in by_kind(docs, "Service")["rlep-learner"]["spec"]["ports"]]
    assert learner_ports == ["metrics"]
    [eval_container] = by_kind(docs, "Deployment")["rlep-eval"]["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert eval_container[probe]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTPS"}


def test_tls_without_a_server_name_fails_with_a_clear_message():
    import helm_python

    with pytest.raises(helm_python.HelmError, match="tls.serverName is empty"):
        render({"tls": {"secretName": "rlep-tls"}})
