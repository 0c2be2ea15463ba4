"""The address a weight broadcast group is given (`weight_sync.master_address`, services/weights/address.py) and the
refusal of a loopback one when a replica is on another host (issue 45: the learner pod's Ray named 127.0.0.1)."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from rlep.common.errors import UserError
from rlep.services.weights.address import NODE_ADDRESS_ENV, is_loopback, node_address
from rlep.services.weights.broadcast import manifest
from rlep.services.weights.config import NcclSyncConfig, WeightSyncConfig
from rlep.services.weights.transport import BroadcastTransport, check_group_address, setup_weight_transport
from tests.unit.test_weights_transport import STATE

REMOTE = ["10.2.0.7:50063", "rlep-rollout-1.rlep-rollout:50063"]  # replicas in other pods
LOCAL = ["127.0.0.1:50063", "localhost:50064"]


class AddressSender:
    """The learner's side of a broadcast, as far as addresses go: rank 0 says where it is."""

    def __init__(self, address: str):
        self.address = address

    def weight_manifest(self):
        return manifest(STATE)

    def broadcast_weights(self, group):
        pass

    def broadcast_address(self):
        return self.address

    def sender_device(self):
        return "cpu"


def test_node_address_is_the_deployments_variable_before_rays_node_ip(monkeypatch):
    import ray

    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.1.2.3")
    assert node_address() == "10.1.2.3"
    monkeypatch.setenv(NODE_ADDRESS_ENV, "")  # set but empty (an unfilled template): not an address
    assert node_address() == ray.util.get_node_ip_address()
    monkeypatch.delenv(NODE_ADDRESS_ENV)
    assert node_address() == ray.util.get_node_ip_address()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),  # Debian's /etc/hosts name for the machine itself
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", True),
        ("10.2.0.7", False),
        ("fd00::7", False),
        ("learner", False),  # a name is not resolved: the replicas resolve it
    ],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) == loopback


def test_a_loopback_group_address_is_refused_only_when_a_replica_is_elsewhere():
    with pytest.raises(UserError) as refused:
        check_group_address("127.0.0.1", [*LOCAL, *REMOTE])
    message = str(refused.value)
    assert "127.0.0.1" in message and all(replica in message for replica in REMOTE)
    assert "weight_sync.master_address" in message and NODE_ADDRESS_ENV in message
    check_group_address("127.0.0.1", LOCAL)  # every replica on this host: loopback reaches them
    check_group_address("10.1.2.3", REMOTE)


def test_the_group_is_at_the_configured_address_else_where_the_sender_says():
    configured = BroadcastTransport(AddressSender("127.0.0.1"), 29650, master_address="10.9.9.9")
    assert configured.group(REMOTE).master_address == "10.9.9.9"
    auto = BroadcastTransport(AddressSender("10.1.2.3"), 29650)
    assert auto.group(REMOTE).master_address == "10.1.2.3"


def test_a_refused_group_is_not_kept_and_takes_no_port():
    sender = AddressSender("127.0.0.1")
    transport = BroadcastTransport(sender, 29650)
    with pytest.raises(UserError, match="is loopback"), transport.prepare(STATE, 1, REMOTE):
        pass
    sender.address = "10.1.2.3"
    assert transport.group(REMOTE).master_port == 29650


def test_setup_passes_the_configured_address_and_auto_asks_the_sender():
    sender = AddressSender("127.0.0.1")
    configured = setup_weight_transport(NcclSyncConfig(backend="gloo", master_address="10.9.9.9"), sender)
    with configured.prepare(STATE, 1, REMOTE) as push:
        addresses = {list(messages)[1].nccl_broadcast.master_address for messages in push.requests}
    assert addresses == {"10.9.9.9"}
    auto = setup_weight_transport(NcclSyncConfig(backend="gloo"), sender)
    with pytest.raises(UserError, match="127.0.0.1 is loopback"):
        auto.group(REMOTE)
    assert auto.group(LOCAL).master_address == "127.0.0.1"


def test_master_address_is_auto_by_default_one_word_and_nccl_only():
    sync = TypeAdapter(WeightSyncConfig)
    assert sync.validate_python({"transport": "nccl"}).master_address == "auto"
    assert sync.validate_python({"transport": "nccl", "master_address": "learner"}).master_address == "learner"
    for bad in ("", "10.0.0.1 ", "a b"):
        with pytest.raises(ValidationError, match="master_address"):
            sync.validate_python({"transport": "nccl", "master_address": bad})
    with pytest.raises(ValidationError, match="master_address"):
        sync.validate_python({"transport": "stream", "master_address": "10.0.0.1"})
