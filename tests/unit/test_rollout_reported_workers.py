"""A weight broadcast's group is sized from what the replicas report over gRPC, not from the learner's config.

Two replicas started elsewhere (Helm, compose, `endpoints.rollout`) at tensor_parallel_size 2 answer GetStatus with
`workers: 2` and record the `nccl_broadcast` chunk of the push they get, over real gRPC on loopback; they stand in
for vLLM, which cannot run TP=2 here. The learner pushes as `Trainer` does: its own engine config says TP=1.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from rlep.common.errors import UserError
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.rollout.client import RolloutClient
from rlep.services.weights.config import NcclSyncConfig
from rlep.services.weights.transport import setup_weight_transport
from tests.conftest import free_port
from tests.unit.test_weights_transport import RecordingSender


class TensorParallelReplica(rollout_pb2_grpc.RolloutServicer):
    """A replica whose engine has `workers` vLLM workers (0: a server older than the field): it takes a push's
    header and broadcast chunk and keeps the chunk (which ranks it was given) instead of joining the group."""

    def __init__(self, workers: int):
        self.workers = workers
        self.broadcasts: list[rollout_pb2.NcclBroadcast] = []

    def GetStatus(self, request, context):  # noqa: N802 - the service's method name
        return rollout_pb2.RolloutStatus(max_model_len=64, workers=self.workers)

    def UpdateWeights(self, request_iterator, context):  # noqa: N802 - the service's method name
        header, chunk = list(request_iterator)
        self.broadcasts.append(chunk.nccl_broadcast)
        return rollout_pb2.UpdateWeightsResponse(version=header.header.version)


@pytest.fixture
def replicas(request):
    """Replicas reporting the `workers` the test names, each behind its own gRPC server on loopback."""
    servers, found = [], {}
    for workers in request.param:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        replica = TensorParallelReplica(workers)
        rollout_pb2_grpc.add_RolloutServicer_to_server(replica, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        found[f"127.0.0.1:{port}"] = replica
    client = RolloutClient(list(found), timeout_s=30)
    yield client, list(found.values())
    client.close()
    for server in servers:
        server.stop(0)


def push(client: RolloutClient, config: NcclSyncConfig, learner_tensor_parallel: int = 1) -> None:
    transport = setup_weight_transport(config, RecordingSender(), learner_tensor_parallel, client.reported_workers)
    client.push_weights(lambda: pytest.fail("a broadcast never reads the state dict"), 1, transport)


@pytest.mark.parametrize("replicas", [(2, 2)], indirect=True)
def test_two_tp2_replicas_get_ranks_1_2_and_3_4_of_5(replicas):
    client, (first, second) = replicas
    assert client.reported_workers([r.address for r in client.replicas]) == [2, 2]
    push(client, NcclSyncConfig(backend="gloo"))
    [mine], [theirs] = first.broadcasts, second.broadcasts
    assert (mine.world_size, mine.rank_offset, theirs.world_size, theirs.rank_offset) == (5, 1, 5, 3)


@pytest.mark.parametrize("replicas", [(4, 1, 0)], indirect=True)
def test_mixed_sizes_and_an_older_server_share_one_group(replicas):
    """TP=4, TP=1 and a server that does not say, counted as this run's engine config (TP=2)."""
    client, found = replicas
    push(client, NcclSyncConfig(backend="gloo"), learner_tensor_parallel=2)
    chunks = [b for r in found for b in r.broadcasts]
    assert [(c.world_size, c.rank_offset) for c in chunks] == [(8, 1), (8, 5), (8, 6)]


@pytest.mark.parametrize("replicas", [(2, 2)], indirect=True)
def test_a_configured_size_the_replicas_contradict_is_refused_before_any_call(replicas):
    client, found = replicas
    with pytest.raises(UserError, match=r"workers_per_replica=1 but rollout replica 127\.0\.0\.1:\d+ reports 2"):
        push(client, NcclSyncConfig(backend="gloo", workers_per_replica=1))
    assert all(r.broadcasts == [] for r in found)
