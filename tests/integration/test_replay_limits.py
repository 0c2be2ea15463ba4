"""Replay's bounds on bad and costly input: rejected with INVALID_ARGUMENT / RESOURCE_EXHAUSTED and a message
naming the limit, before the work where possible, and work that stops when its caller has gone."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from rlep.common.config import ServerConfig
from rlep.common.grpc_channel import make_channel
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.errors import CallAbandoned
from rlep.services.replay.main import start_replay
from rlep.services.replay.store import RedisReplayStore

pytestmark = pytest.mark.integration


def traj(qid: str, i: int, tokens: int = 4, text_bytes: int = 0) -> trajectory_pb2.Trajectory:
    return trajectory_pb2.Trajectory(
        question_id=qid,
        response_text=f"answer {i} " + "x" * text_bytes,
        reward=1.0,
        verdict=trajectory_pb2.CORRECT,
        response_token_ids=list(range(i, i + tokens)),
    )


def add(stub, pool: str, trajectories, questions=()) -> replay_pb2.AddTrajectoriesResponse:
    request = replay_pb2.AddTrajectoriesRequest(pool=pool, trajectories=trajectories, questions=questions)
    return stub.AddTrajectories(request, timeout=30)


def abort_of(call, request, timeout: float = 30) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=timeout)
    return err.value.code(), err.value.details()


class GatedStore(RedisReplayStore):
    """The real store, holding its first per-question draw until `release` is set (to cancel mid-work)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.release, self.draws, self.budget = threading.Event(), threading.Event(), 0, None

    def _sample_by_attributes(self, *args, **kwargs):
        self.draws += 1
        self.budget = args[-1]  # its keep_going() raises once the server sees the caller gone
        self.entered.set()
        self.release.wait(timeout=60)
        return super()._sample_by_attributes(*args, **kwargs)


@pytest.fixture
def limited(redis_url, pool_name):
    """A replay server with small limits over the session's Redis, its stub, and a fresh pool name."""
    config = ReplayConfig(
        server=ServerConfig(port=0),
        redis_url=redis_url,
        max_sample_trajectories=1000,
        max_sample_bytes=1 << 20,
        max_diverse_pairs=100,
        max_question_bytes=4096,
    )
    running = start_replay(config)
    running.servicer.store = GatedStore(running.store.client, config.capacity_per_question, config.eviction)
    running.servicer.store.release.set()
    stub = replay_pb2_grpc.ReplayBufferStub(make_channel(f"127.0.0.1:{running.port}"))
    yield running, stub, pool_name
    running.stop()


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_are_invalid_argument(limited, reward):
    _, stub, pool = limited
    bad = traj("q", 1)
    bad.reward = reward
    code, details = abort_of(stub.AddTrajectories, replay_pb2.AddTrajectoriesRequest(pool=pool, trajectories=[bad]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "trajectories[0].reward" in details and "finite" in details
    assert pool not in stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=10).pools  # nothing stored


def test_an_unknown_verdict_rejects_only_its_trajectory(limited):
    _, stub, pool = limited
    odd = traj("q", 2)
    odd.verdict = 99
    reply = add(stub, pool, [traj("q", 1), odd])
    assert (reply.added, reply.rejected) == (1, 1)
    assert reply.rejections[0].index == 1 and reply.rejections[0].reason == "unknown verdict 99"


def test_question_metadata_and_sample_ids_have_size_limits(limited):
    _, stub, pool = limited
    big = replay_pb2.Question(question_id="q", ground_truth="x" * 5000)
    code, details = abort_of(
        stub.AddTrajectories, replay_pb2.AddTrajectoriesRequest(pool=pool, trajectories=[traj("q", 1)], questions=[big])
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "over max_question_bytes 4096" in details
    add(stub, pool, [traj("q", 1)])
    for qid, phrase in (("", "question_ids[1]: missing question_id"), ("q" * 300, "longer than 256 characters")):
        request = replay_pb2.SampleRequest(pool=pool, question_ids=["q", qid], m=1)
        code, details = abort_of(stub.Sample, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and phrase in details


def test_export_chunk_size_must_be_in_range(limited):
    _, stub, pool = limited
    add(stub, pool, [traj(f"q{q}", i) for q in range(5) for i in range(3)])
    for size in (-1, 5000):
        code, details = abort_of(
            lambda r, timeout: list(stub.ExportPool(r, timeout=timeout)),
            replay_pb2.ExportPoolRequest(pool=pool, questions_per_chunk=size),
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "questions_per_chunk must be in 1..4096" in details
    assert sum(len(c.trajectories) for c in stub.ExportPool(replay_pb2.ExportPoolRequest(pool=pool), timeout=30)) == 15


def test_an_interrupted_import_converges_when_run_again(limited):
    running, stub, pool = limited
    chunks = [replay_pb2.PoolChunk(pool=pool, trajectories=[traj(f"q{c}", i) for i in range(4)]) for c in range(5)]

    def interrupted():
        yield chunks[0]
        # Wait until the server has applied the first chunk, then break the stream as a crash would.
        deadline = time.monotonic() + 30
        while pool not in running.store.pools() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("client crashed")

    with pytest.raises(grpc.RpcError) as err:
        stub.ImportPool(interrupted(), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNKNOWN  # the client's own iterator failed
    partial = stub.GetPoolStats(replay_pb2.GetPoolStatsRequest(pool=pool), timeout=10).trajectories
    assert 4 <= partial < 20
    reply = stub.ImportPool(iter(chunks), timeout=30)
    assert (reply.added, reply.duplicate) == (20 - partial, partial)
    stats = stub.GetPoolStats(replay_pb2.GetPoolStatsRequest(pool=pool), timeout=10)
    assert (stats.questions, stats.trajectories) == (5, 20)


def test_sample_reply_size_is_bounded_before_it_is_built(limited):
    _, stub, pool = limited
    add(stub, pool, [traj("u", i, text_bytes=100_000) for i in range(4)])
    ok = stub.Sample(replay_pb2.SampleRequest(pool=pool, question_ids=["u"] * 2, m=4), timeout=30)
    assert [len(s.trajectories) for s in ok.samples] == [4, 4]
    # 1000 ids x m=1 is within max_sample_trajectories, but would return ~100 MB from one 0.4 MB draw.
    code, details = abort_of(stub.Sample, replay_pb2.SampleRequest(pool=pool, question_ids=["u"] * 1000, m=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "over the limit of 1048576 (max_sample_bytes)" in details
    code, details = abort_of(stub.Sample, replay_pb2.SampleRequest(pool=pool, question_ids=["u"] * 501, m=2))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "up to 1002 trajectories (question ids x m), over the limit of 1000 (max_sample_trajectories)" in details


def test_diverse_cost_is_bounded_and_repeated_ids_are_drawn_once(limited):
    _, stub, pool = limited
    add(stub, pool, [traj(q, i) for q in ("a", "b") for i in range(8)])
    diverse = replay_pb2.DIVERSE
    # 64 pairs per question: "a" alone fits max_diverse_pairs=100, repeated or not; "a" and "b" do not.
    reply = stub.Sample(replay_pb2.SampleRequest(pool=pool, question_ids=["a"] * 5, m=3, strategy=diverse), timeout=30)
    assert len({tuple(t.response_text for t in s.trajectories) for s in reply.samples}) == 1
    code, details = abort_of(
        stub.Sample, replay_pb2.SampleRequest(pool=pool, question_ids=["a", "b"], m=3, strategy=diverse)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "compare 128 pairs of successes, over the limit of 100 (max_diverse_pairs)" in details


def test_sampling_stops_when_the_deadline_passes(limited):
    running, stub, pool = limited
    add(stub, pool, [traj(f"q{q}", 0) for q in range(20)])
    store = running.servicer.store
    store.release.clear()
    request = replay_pb2.SampleRequest(
        pool=pool, question_ids=[f"q{q}" for q in range(20)], m=1, strategy=replay_pb2.RECENCY
    )
    future = stub.Sample.future(request, timeout=1.0)
    assert store.entered.wait(timeout=30)
    assert future.exception(timeout=30).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The client gives up at its deadline; the server learns it a moment later. Wait for that, then let the
    # first question's draw finish: the next unit of work must not start.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            store.budget.keep_going()
        except CallAbandoned:
            break
        time.sleep(0.01)
    store.release.set()
    # The server sees the client's cancellation (sent at its deadline) or its own deadline, whichever is first.
    requests = running.servicer.metrics.requests
    stopped = [requests.labels("Sample", code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")]
    deadline = time.monotonic() + 30
    while sum(c._value.get() for c in stopped) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(c._value.get() for c in stopped) == 1
    assert store.draws == 1  # not the other 19 questions


def _script_calls(client) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


def test_a_huge_add_for_one_question_runs_in_bounded_script_calls_with_the_same_outcome(limited):
    """20,000 rows for one question were one Lua call holding Redis (every other client) for 1-5 s (issue 31)."""
    from rlep.services.replay.store import ADD_CHUNK_ROWS

    running, stub, pool = limited
    rows = [traj("q", i) for i in range(20_000)]
    before = _script_calls(running.store.client)
    reply = add(stub, pool, rows, questions=[replay_pb2.Question(question_id="q", ground_truth="1")])
    calls = _script_calls(running.store.client) - before
    capacity = running.store.capacity
    assert (reply.added, reply.duplicate, reply.evicted) == (20_000, 0, 20_000 - capacity)
    assert calls >= 20_001 // ADD_CHUNK_ROWS, f"{calls} script calls for 20,001 rows"
    # Eviction ran row by row as before: the newest `capacity` answers are the ones kept.
    kept = stub.Sample(replay_pb2.SampleRequest(pool=pool, question_ids=["q"], m=capacity), timeout=30)
    texts = {t.response_text for t in kept.samples[0].trajectories}
    assert texts == {rows[i].response_text for i in range(20_000 - capacity, 20_000)}
