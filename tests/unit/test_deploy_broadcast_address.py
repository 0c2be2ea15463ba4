"""The address the deployed learner gives its weight broadcast group (`weight_sync.transport: nccl`), as the Helm
chart and docker-compose.yml start it: its pod's or container's own, never the 127.0.0.1 its loopback-held Ray names
(issue 45). Each test runs the learner's own config loading and transport on what the deployment hands the process.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from rlep.common.config import load_config
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.policy import DeepSpeedPolicy
from rlep.services.weights.address import NODE_ADDRESS_ENV
from rlep.services.weights.transport import setup_weight_transport
from tests.unit.test_deploy_compose import compose, shell  # noqa: F401 (compose is a fixture)
from tests.unit.test_helm_chart import LEARNER_ON, by_kind, learner_job, local, render
from tests.unit.test_weights_broadcast_address import AddressSender

POD_IP = "10.4.2.17"  # what the kubelet would put in status.podIP
OTHER_PODS = ["10.4.3.5:50063", "10.4.4.9:50063"]  # rollout replicas as the learner resolves its service


class LearnerRank0(AddressSender):
    """The learner's policy as far as the broadcast's address goes: its own `broadcast_address`, which rank 0's
    process answers in its environment (this process's, here: the pod's)."""

    def broadcast_address(self):
        return DeepSpeedPolicy.broadcast_address(self)


def sent_address(config: TrainConfig, replicas: list[str]) -> str:
    """The group address each replica's UpdateWeights call carries in the learner's first push."""
    transport = setup_weight_transport(config.weight_sync, LearnerRank0(""))
    with transport.prepare({}, 1, replicas) as push:
        [address] = {list(messages)[1].nccl_broadcast.master_address for messages in push.requests}
    return address


def pod_environment(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet fills it: values as written, the pod IP where asked for."""
    environ = {}
    for entry in container.get("env", []):
        field = entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if "value" in entry or field:
            environ[entry["name"]] = POD_IP if field == "status.podIP" else entry.get("value", f"<{field}>")
    return environ


def test_the_learner_pod_sends_its_pod_ip_to_the_rollout_pods(monkeypatch, tmp_path):
    docs = render({"learner": {**LEARNER_ON, "config": {"weight_sync": {"transport": "nccl"}}}})
    [container] = [c for c in learner_job(docs)["spec"]["template"]["spec"]["containers"] if c["name"] == "learner"]
    environ = pod_environment(container)
    assert environ.get(NODE_ADDRESS_ENV) == POD_IP, "the learner pod is not given its IP (downward API status.podIP)"
    token = tmp_path / "token"
    token.write_text("x\n")
    train_yaml = local(by_kind(docs, "ConfigMap")["rlep-config"]["data"]["train.yaml"], token)
    config = load_config(TrainConfig, train_yaml, env_prefix="train", environ=environ)  # as `rlep train` loads it
    assert config.weight_sync.master_address == "auto"
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert sent_address(config, OTHER_PODS) == POD_IP


def test_the_compose_learner_exports_its_container_address(compose):  # noqa: F811
    """The learner's entrypoint exports the address the container's name resolves to (Docker's /etc/hosts maps it
    to the container's IP on the compose network, as the rollout container reaches it; a `docker-compose run`
    container has no `learner` name there) and runs the service's command."""
    service = compose["services"]["learner"]
    entrypoint = [shell(part).replace("python -c", f"{sys.executable} -c") for part in service["entrypoint"]]
    shown = subprocess.run([*entrypoint, "env"], capture_output=True, text=True, timeout=60, check=True).stdout
    exported = [line for line in shown.splitlines() if line.startswith(f"{NODE_ADDRESS_ENV}=")]
    assert exported == [f"{NODE_ADDRESS_ENV}={socket.gethostbyname(socket.gethostname())}"]
