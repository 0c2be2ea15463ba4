"""A Ray Serve rollout replica's fixed gRPC port: replicas of one node get distinct ports, a port in use or a
full range is a clear error (never a random port), and no gRPC server silently shares a port with another."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from pydantic import ValidationError

from rlep.services.rollout.replica_port import NoFreeReplicaPort, claim_port
from tests.conftest import free_port

HOST = "127.0.0.1"


def free_range(count: int) -> int:
    """A base port with `count` free ports after it."""
    for _ in range(50):
        base = free_port()
        if base + count <= 65535 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def test_port_zero_means_any_free_port_and_claims_nothing(tmp_path):
    claim = claim_port(HOST, 0, slots=4, lock_dir=tmp_path)
    assert claim.port == 0 and claim.lock is None
    assert list(tmp_path.iterdir()) == []


def test_replicas_of_one_node_take_distinct_slots_and_a_full_node_is_an_error(tmp_path):
    base = free_range(2)
    first = claim_port(HOST, base, slots=2, lock_dir=tmp_path)
    second = claim_port(HOST, base, slots=2, lock_dir=tmp_path)
    assert (first.port, second.port) == (base, base + 1)
    with pytest.raises(NoFreeReplicaPort, match=rf"{base} \(claimed by another replica\), {base + 1} \(claimed"):
        claim_port(HOST, base, slots=2, lock_dir=tmp_path)
    first.release()  # a replica that stops (or dies) frees its slot
    assert claim_port(HOST, base, slots=2, lock_dir=tmp_path).port == base


def test_a_port_something_else_listens_on_is_passed_over(tmp_path):
    base = free_range(2)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind((HOST, base))
        other.listen(1)
        assert claim_port(HOST, base, slots=2, lock_dir=tmp_path).port == base + 1
        with pytest.raises(NoFreeReplicaPort, match=rf"{base} \(in use\)"):
            claim_port(HOST, base, slots=1, lock_dir=tmp_path)


def test_a_killed_replicas_claim_is_freed_with_its_process(tmp_path):
    base = free_range(1)
    code = (
        "import sys, time; from pathlib import Path; from rlep.services.rollout.replica_port import claim_port; "
        f"claim = claim_port('{HOST}', {base}, 1, Path(sys.argv[1])); print(claim.port, flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == str(base)
        with pytest.raises(NoFreeReplicaPort):
            claim_port(HOST, base, slots=1, lock_dir=tmp_path)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs
        holder.wait()
    assert claim_port(HOST, base, slots=1, lock_dir=tmp_path).port == base


def test_two_grpc_servers_never_share_a_port():
    """gRPC's default (SO_REUSEPORT) would let a second replica bind the first one's port and split its traffic."""
    from rlep.common.config import ServerConfig
    from rlep.common.grpc_server import build_server

    config = ServerConfig(host=HOST, port=free_port())
    first, port, _ = build_server(config, lambda server: None, [])
    try:
        assert port == config.port
        with pytest.raises((RuntimeError, OSError)):
            build_server(config, lambda server: None, [])
    finally:
        first.stop(0)


def test_the_port_range_is_checked_where_it_is_configured():
    from rlep.services.learner.config import LocalServicesConfig
    from rlep.services.rollout.ray_app import RolloutAppArgs, app_builder

    assert RolloutAppArgs(port=50063, num_replicas=4).port_slots == 4
    assert RolloutAppArgs(port=50063, num_replicas=4, max_per_node=1).port_slots == 1
    with pytest.raises(ValidationError, match="ports 65535..65536 .* not a valid range"):
        RolloutAppArgs(port=65535, num_replicas=2)
    with pytest.raises(ValidationError, match="port"):
        app_builder({"port": 70000})
    with pytest.raises(ValidationError, match="local.rollout_port: ports 65534..65536"):
        LocalServicesConfig(rollout_port=65534, rollout_replicas=3)
    # The replica receives the base port and its node's slot count.
    bound = app_builder({"port": 50100, "num_replicas": 3, "max_per_node": 2})._bound_deployment
    assert bound.init_args[2:] == (50100, 2)


def test_the_metrics_port_range_is_checked_and_named_where_it_is_configured(tmp_path):
    """`local.rollout_metrics_port` takes a slot per replica like `rollout_port`; a bad range, one overlapping the gRPC
    ports, or a full node is an error naming the setting."""
    from rlep.services.learner.config import LocalServicesConfig
    from rlep.services.rollout.ray_app import app_builder
    from rlep.services.rollout.replica_port import METRICS_PORT_SETTING

    assert LocalServicesConfig().rollout_metrics_port is None  # off unless asked
    LocalServicesConfig(rollout_port=50100, rollout_metrics_port=50102, rollout_replicas=2)  # apart: fine
    with pytest.raises(ValidationError, match="local.rollout_metrics_port: ports 65534..65536"):
        LocalServicesConfig(rollout_metrics_port=65534, rollout_replicas=3)
    with pytest.raises(ValidationError, match=r"local.rollout_metrics_port: /metrics ports 50101..50102 overlap"):
        LocalServicesConfig(rollout_port=50100, rollout_metrics_port=50101, rollout_replicas=2)
    with pytest.raises(ValidationError, match="metrics_port: /metrics ports 50100..50100 overlap"):
        app_builder({"port": 50100, "metrics_port": 50100})
    bound = app_builder({"port": 50100, "num_replicas": 2, "metrics_port": 9463})._bound_deployment
    assert bound.init_kwargs == {"metrics_port": 9463}
    base = free_range(1)
    with socket.socket() as other:
        other.bind((HOST, base))
        other.listen(1)
        with pytest.raises(NoFreeReplicaPort, match=rf"local.rollout_metrics_port .* {base} \(in use\)"):
            claim_port(HOST, base, slots=1, lock_dir=tmp_path, setting=METRICS_PORT_SETTING)
