"""Rollout replicas named by DNS (`NAME:PORT`): the address set is resolved again at every learner step, so a
replica rescheduled onto a new pod (a new IP, the same fixed port) is found, brought to the learner's version
before it serves, and a replica that is gone stops being used.

The replicas here are real gRPC servers on two loopback IPs sharing one port, as two pods would; only the
resolver stands in for the cluster's DNS."""

from __future__ import annotations

import socket
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.learner.trainer import Trainer
from rlep.services.rollout.client import RolloutClient, RolloutError
from rlep.services.rollout.discovery import parse_service, resolve_service
from tests.conftest import free_port

POD_IPS = ("127.0.0.1", "127.0.0.2")  # all of 127/8 is loopback on Linux


class FakeReplica(rollout_pb2_grpc.RolloutServicer):
    """A replica's status and version over real gRPC (no engine)."""

    def __init__(self, version: int = 0):
        self.version = version

    def GetStatus(self, request, context):  # noqa: N802 - the service's method name
        return rollout_pb2.RolloutStatus(policy_version=self.version, max_model_len=64)


@pytest.fixture
def pods():
    port = free_port()
    replicas, servers = {}, []
    for ip in POD_IPS:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
        replicas[ip] = FakeReplica()
        rollout_pb2_grpc.add_RolloutServicer_to_server(replicas[ip], server)
        server.add_insecure_port(f"{ip}:{port}")
        server.start()
        servers.append(server)
    yield port, replicas
    for server in servers:
        server.stop(0)


class FakeDns:
    """getaddrinfo over a record set the test changes, as pods come and go behind a headless Service."""

    def __init__(self, *ips: str):
        self.ips = list(ips)

    def __call__(self, host, port, type=0):  # noqa: A002 - getaddrinfo's parameter name
        if not self.ips:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in self.ips]


def test_names_resolve_to_sorted_distinct_addresses_and_nothing_on_nxdomain():
    assert parse_service("rlep-rollout-replicas.ml.svc:50063") == ("rlep-rollout-replicas.ml.svc", 50063)
    with pytest.raises(ValueError, match="NAME:PORT"):
        parse_service("rlep-rollout-replicas")
    # The real resolver: localhost is on every machine.
    assert "127.0.0.1:50063" in resolve_service("localhost:50063")

    def records(host, port, type=0):  # noqa: A002
        ips = ["10.0.0.10", "10.0.0.9", "10.0.0.10", "fd00::1"]
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, type, 6, "", (ip, port)) for ip in ips]

    assert resolve_service("svc:1", records) == ["10.0.0.9:1", "10.0.0.10:1", "[fd00::1]:1"]
    assert resolve_service("svc:1", FakeDns()) == []


def test_learner_steps_follow_a_replica_onto_a_new_pod_and_update_it_before_it_serves(pods):
    port, replicas = pods
    dns = FakeDns("127.0.0.1")
    client = RolloutClient.from_service(f"rlep-rollout-replicas:{port}", resolve=dns)
    pushed: list[list[str]] = []

    def push_weights(replicas=None):  # what the learner's push does to a replica: it now serves our version
        pushed.append([r.address for r in replicas])
        for replica in replicas:
            pods_replica(replica.address).version = learner.version

    def pods_replica(address: str) -> FakeReplica:
        return replicas[address.rsplit(":", 1)[0]]

    learner = SimpleNamespace(services=SimpleNamespace(rollout=client), version=3, push_weights=push_weights)
    replicas["127.0.0.1"].version = 3
    Trainer.sync_rollout(learner)  # the learner's own check before each step
    assert [r.address for r in client.serving()] == [f"127.0.0.1:{port}"] and pushed == []

    # The pod is rescheduled: a new IP, its replica at its initial weights, the old IP gone from DNS.
    dns.ips = ["127.0.0.2"]
    Trainer.sync_rollout(learner)
    assert pushed == [[f"127.0.0.2:{port}"]], "the replica on the new pod was not brought to our version"
    assert [r.address for r in client.serving()] == [f"127.0.0.2:{port}"]
    assert client.versions() == [3]

    # A second pod joins; a DNS outage (no records) keeps the replicas the learner knows.
    dns.ips = ["127.0.0.2", "127.0.0.1"]
    replicas["127.0.0.1"].version = 0
    learner.version = 4
    Trainer.sync_rollout(learner)
    assert sorted(a for batch in pushed[1:] for a in batch) == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
    dns.ips = []
    Trainer.sync_rollout(learner)
    assert len(client.serving()) == 2 and client.versions() == [4, 4]
    client.close()


def test_a_service_that_names_no_replica_at_start_is_an_error():
    with pytest.raises(RolloutError, match="does not resolve"):
        RolloutClient.from_service("rlep-rollout-replicas:50063", resolve=FakeDns())


def test_eval_samples_only_from_replicas_on_the_learners_newest_version(pods):
    """Eval never pushes to the learner's replicas: one back at its initial weights waits for the learner."""
    from rlep.services.eval.runner import follow_replicas

    port, replicas = pods
    dns = FakeDns("127.0.0.1")
    client = RolloutClient.from_service(f"rlep-rollout-replicas:{port}", resolve=dns)
    replicas["127.0.0.1"].version, replicas["127.0.0.2"].version = 5, 0
    dns.ips = ["127.0.0.1", "127.0.0.2"]  # a second replica came up since the last job
    follow_replicas(client, newest_only=True)
    assert len(client.replicas) == 2 and [r.address for r in client.serving()] == [f"127.0.0.1:{port}"]
    replicas["127.0.0.2"].version = 5  # the learner updated it
    follow_replicas(client, newest_only=True)
    assert len(client.serving()) == 2
    client.close()
