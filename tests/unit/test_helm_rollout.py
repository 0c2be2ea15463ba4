"""How the learner and eval reach the rollout replicas of the rendered chart: one fixed gRPC port per worker pod,
the only port the NetworkPolicy opens to them, and a headless Service they resolve again before every step / job.

Guards against replicas on free ports (a policy that must admit every port), a Service, containerPort, replica
argument and client config that disagree on the port, and addresses read once at pod start."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.test_helm_chart import CUSTOM_VALUES, LEARNER_ON, by_kind, render

RAY_PODS = {"rollout", "rollout-head"}


@pytest.fixture(scope="module", params=["default", "gpu", "port"])
def docs(request) -> list[dict]:
    values = {
        "default": {"learner": LEARNER_ON},
        "gpu": CUSTOM_VALUES,
        "port": {"learner": LEARNER_ON, "rollout": {"port": 41000}},
    }[request.param]
    return render(values)


def rollout_app(docs: list[dict]) -> dict:
    [service] = by_kind(docs, "RayService").values()
    [app] = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    return app


def policy_of(docs: list[dict], component: str) -> dict:
    [policy] = [
        p
        for p in by_kind(docs, "NetworkPolicy").values()
        if p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
    ]
    return policy


def components(rule: dict) -> set[str]:
    return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule.get("from", [])}


def test_rollout_workers_admit_learner_and_eval_on_the_replica_port_only(docs):
    port = rollout_app(docs)["args"]["port"]
    callers_ports = set()
    for rule in policy_of(docs, "rollout")["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if not ports:  # every port: only Ray's own pods, never the learner or eval
            assert rule.get("from") and components(rule) <= RAY_PODS, rule
        elif components(rule) & {"learner", "eval"}:
            callers_ports |= ports
    assert callers_ports == {port}


def test_a_weight_broadcast_opens_the_workers_to_the_learner_alone():
    """NCCL/gloo process groups connect on free ports both ways: only then is the learner admitted on all."""
    docs = render({"learner": {**LEARNER_ON, "config": {"weight_sync": {"transport": "nccl"}}}})
    open_rules = [r for r in policy_of(docs, "rollout")["spec"]["ingress"] if r.get("from") and not r.get("ports")]
    assert {frozenset(components(r)) for r in open_rules} == {frozenset(RAY_PODS), frozenset({"learner"})}


def test_replicas_serve_the_port_their_pods_and_headless_service_declare(docs):
    from rlep.services.rollout.discovery import parse_service

    args = rollout_app(docs)["args"]
    port = args["port"]
    assert args["max_per_node"] == 1, "one replica per pod: a second would take another port"
    [service] = by_kind(docs, "RayService").values()
    [workers] = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    [worker] = workers["template"]["spec"]["containers"]
    assert {"name": "grpc", "containerPort": port} in worker["ports"]
    replicas = by_kind(docs, "Service")["rlep-rollout-replicas"]
    assert replicas["spec"]["clusterIP"] == "None", "a ClusterIP would hide the replicas behind one address"
    assert replicas["spec"]["selector"].items() <= workers["template"]["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in replicas["spec"]["ports"]] == [(port, "grpc")]

    files = by_kind(docs, "ConfigMap")["rlep-config"]["data"]
    train = yaml.safe_load(files["train.yaml"])
    assert parse_service(train["endpoints"]["rollout_service"]) == ("rlep-rollout-replicas", port)
    assert "rollout" not in train["endpoints"], "addresses fixed at start would never follow a rescheduled pod"
    eval_rollout = yaml.safe_load(files["eval.yaml"])["rollout"]
    if "addresses" not in eval_rollout:  # the gpu values give eval explicit addresses
        assert parse_service(eval_rollout["service"]) == ("rlep-rollout-replicas", port)


def test_a_port_outside_1_to_65535_fails_the_render():
    import helm_python

    for port in (0, 70000):
        with pytest.raises(helm_python.HelmError, match="rollout.port"):
            render({"rollout": {"port": port}})
