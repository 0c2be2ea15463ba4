"""The deadline of a Generate call grows with what the call may sample (`GenerateDeadline`): the paper's calls are
not cut at a fixed bound they need most of, and a call past its deadline is reported as such, size and deadline
named. Sizing: docs/scaling.md, *Generate deadline*."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest

from rlep.common.config import load_config
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.learner.config import TrainConfig
from rlep.services.rollout.client import RolloutClient, RolloutError
from rlep.services.rollout.config import GenerateDeadline
from rlep.services.rollout.types import Sampling
from tests.conftest import REPO_ROOT

# The estimate of one call of the paper's run on an H100 replica: 2,048 samples x 3,072 tokens in 250-500 s,
# i.e. 12.6k-25.2k sampled tokens/s. Never measured here (no GPU): the deadline must leave room above its slow end.
SLOW_TOKENS_PER_S = 2048 * 3072 / 500
MARGIN = 2.0


class _Recorder:
    """A replica's Generate that records the deadline it was given and answers with empty completions."""

    def __init__(self):
        self.timeouts: list[float] = []

    def Generate(self, request, timeout=None):  # noqa: N802 - the gRPC stub's method name
        self.timeouts.append(timeout)
        return rollout_pb2.GenerateResponse(completions=[rollout_pb2.Completion() for _ in request.prompts])


def deadlines_per_replica(config: TrainConfig, questions: int, sampling: Sampling) -> list[float]:
    """The deadline each replica gets for generating `questions` questions under `config` in one `generate`."""
    replicas = config.local.rollout_replicas
    client = RolloutClient(
        [f"127.0.0.1:{i + 1}" for i in range(replicas)], generate_deadline=config.endpoints.generate_deadline
    )
    try:
        recorders = [_Recorder() for _ in range(replicas)]
        for replica, recorder in zip(client.replicas, recorders, strict=True):
            replica.stub = recorder
        client.generate([[1]] * questions, sampling)
        return [t for recorder in recorders for t in recorder.timeouts]
    finally:
        client.close()


def papers_call(recipe: str) -> tuple[TrainConfig, int, Sampling]:
    """The recipe's config and its largest `generate`: questions and sampling (training step, dynamic-sampling
    round, or collection chunk)."""
    config = load_config(TrainConfig, REPO_ROOT / "configs" / "recipes" / f"{recipe}.yaml")
    algo, dynamic, collect = config.algorithm, config.algorithm.dynamic_sampling, config.collect
    if recipe == "collect":
        return (
            config,
            collect.questions_per_chunk,
            Sampling(n=collect.samples_per_question, max_tokens=collect.max_response_tokens),
        )
    questions = (dynamic.questions_per_round or algo.questions_per_step) if dynamic.enabled else algo.questions_per_step
    return config, questions, Sampling(n=algo.fresh_per_question, max_tokens=algo.max_response_tokens)


@pytest.mark.parametrize(("recipe", "slow_s"), [("rlep", 500), ("dapo", 1500), ("collect", 1000)])
def test_the_papers_calls_get_a_deadline_above_what_the_arithmetic_needs(recipe, slow_s):
    config, questions, sampling = papers_call(recipe)
    per_replica = questions // config.local.rollout_replicas  # one call each: under max_prompts_per_call
    needed_s = per_replica * sampling.n * sampling.max_tokens / SLOW_TOKENS_PER_S
    assert needed_s == pytest.approx(slow_s)  # docs/scaling.md's figures
    deadlines = deadlines_per_replica(config, questions, sampling)
    assert len(deadlines) == config.local.rollout_replicas
    assert min(deadlines) >= MARGIN * needed_s, f"{recipe}: {min(deadlines):.0f} s for a call of ~{needed_s:.0f} s"


def test_a_smaller_call_gets_a_shorter_deadline():
    deadline = GenerateDeadline()
    assert deadline.seconds(128, 16, 3072) == pytest.approx(600 + 0.2 * 6291.456)
    assert deadline.seconds(128, 16, 768) < deadline.seconds(128, 16, 3072)
    assert deadline.seconds(0, 16, 3072) == deadline.floor_s


def test_the_deadline_is_validated_and_set_like_any_field():
    with pytest.raises(ValueError, match="greater than 0"):
        GenerateDeadline(floor_s=0)
    with pytest.raises(ValueError, match="greater than 0"):
        GenerateDeadline(s_per_1k_tokens=-1)
    with pytest.raises(ValueError, match="Extra inputs"):
        GenerateDeadline(seconds=5)
    config = load_config(TrainConfig, sets=["endpoints.generate_deadline.s_per_1k_tokens=1.5"])
    assert config.endpoints.generate_deadline.seconds(1, 1, 1000) == 600 + 1.5


class StalledReplica(rollout_pb2_grpc.RolloutServicer):
    """A replica alive but slower than the deadline assumes: it answers nothing until the call ends."""

    def __init__(self):
        self.time_remaining: list[float] = []

    def Generate(self, request, context):  # noqa: N802 - the service's method name
        self.time_remaining.append(context.time_remaining())
        ended = threading.Event()
        context.add_callback(ended.set)
        ended.wait(timeout=60)
        return rollout_pb2.GenerateResponse()


@contextmanager
def serve_stalled_replica():
    """A stalled replica on a real gRPC server on loopback: (its address, the servicer)."""
    replica = StalledReplica()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rollout_pb2_grpc.add_RolloutServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", replica
    finally:
        server.stop(0)


@pytest.fixture
def stalled_replica():
    with serve_stalled_replica() as served:
        yield served


def test_a_call_past_its_deadline_is_reported_with_its_size_and_deadline(stalled_replica):
    address, replica = stalled_replica
    # 2 prompts x n=2 x 250 tokens = 1,000 tokens: 1 s + 1 s per thousand = a 2 s deadline.
    client = RolloutClient([address], attempts=1, generate_deadline=GenerateDeadline(floor_s=1.0, s_per_1k_tokens=1.0))
    started = time.monotonic()
    try:
        with pytest.raises(RolloutError) as err:
            client.generate([[1, 2], [3]], Sampling(n=2, max_tokens=250))
    finally:
        client.close()
    elapsed = time.monotonic() - started
    message = str(err.value)
    assert "DEADLINE_EXCEEDED" in message and "2 prompts x n=2 x 250 tokens" in message, message
    assert "deadline of 2 s" in message, message
    [remaining] = replica.time_remaining  # the replica was told the derived deadline (its engine is bound by it)
    assert 1.0 < remaining < 2.5  # 2 s, give or take the clocks' reading
    assert 2.0 <= elapsed < 10.0
    assert client.failovers == 1


# 2 prompts x n=2 x 250 tokens = 1,000 tokens: 0.5 s + 0.5 s per thousand = a 1 s deadline per attempt.
SMALL = {"floor_s": 0.5, "s_per_1k_tokens": 0.5}


def test_eval_gives_its_rollout_client_the_configured_deadline(stalled_replica):
    from rlep.services.eval.config import EvalConfig
    from rlep.services.eval.main import build_backends

    address, replica = stalled_replica
    backends = build_backends(
        EvalConfig.model_validate({"rollout": {"addresses": [address], "generate_deadline": SMALL}})
    )
    try:
        with pytest.raises(RolloutError, match="deadline of 1 s"):
            backends.rollout.generate([[1, 2], [3]], Sampling(n=2, max_tokens=250))
    finally:
        backends.rollout.close()
    assert all(0.5 < remaining < 1.5 for remaining in replica.time_remaining), replica.time_remaining
