"""Sample's two reply forms over a real gRPC server and a real Redis: trajectories as stored bytes
(`trajectories_as_bytes`, what ReplayClient asks for) and as messages (older clients)."""

from __future__ import annotations

import pytest

from rlep.common.types import FinishReason, Source, Trajectory, Verdict
from rlep.common.v1 import trajectory_pb2
from rlep.common.wire import trajectory_to_proto
from rlep.replay.v1 import replay_pb2
from rlep.services.replay.client import sampled_trajectories
from rlep.services.replay.store import pool_prefix

pytestmark = pytest.mark.integration


def full_trajectory(qid: str, i: int) -> Trajectory:
    """Every field set to a value other than its default, so a dropped field changes the result."""
    return Trajectory(
        qid,
        f"step {i}: x = {i} so the answer is \\boxed{{{i}}} — ünïcode",
        reward=0.75 + i,
        source=Source.REPLAY,
        verdict=Verdict.CORRECT,
        policy_version=3 + i,
        finish_reason=FinishReason.LENGTH,
        prompt_token_ids=(5, 1000, 70_000 + i),
        response_token_ids=(i, 2, 300_000),
        behavior_logprobs=(-0.5, -1.25, -0.125 * i),
        prompt_text=f"Q{i}: what is x?",
        run_id="run-7",
        created_at_ms=1_700_000_000_000 + i,
        tokenizer_fingerprint="ab" * 32,
    )


def test_bytes_and_message_replies_round_trip_every_field(replay_client, pool_name):
    stored = {q: [full_trajectory(q, i) for i in range(3)] for q in ("q1", "q2")}
    assert replay_client.add(pool_name, [t for ts in stored.values() for t in ts]).added == 6
    typed = replay_client.sample(pool_name, ["q1", "q2", "absent"], m=3, seed=1)
    expected = {**{q: set(ts) for q, ts in stored.items()}, "absent": set()}
    assert {q: set(ts) for q, ts in typed.items()} == expected

    request = replay_pb2.SampleRequest(pool=pool_name, question_ids=["q1", "q2"], m=3, seed=1)
    request.trajectories_as_bytes = True
    as_bytes = replay_client.stub.Sample(request, timeout=10)
    request.trajectories_as_bytes = False
    as_messages = replay_client.stub.Sample(request, timeout=10)  # what a client predating the field gets
    for by_bytes, by_message in zip(as_bytes.samples, as_messages.samples, strict=True):
        assert len(by_bytes.trajectory_bytes) == 3 and not by_bytes.trajectories
        assert len(by_message.trajectories) == 3 and not by_message.trajectory_bytes
        assert by_bytes.available == by_message.available == 3
        # Same draw, same content: the bytes are the stored serialization of the message form.
        assert [trajectory_pb2.Trajectory.FromString(b) for b in by_bytes.trajectory_bytes] == list(
            by_message.trajectories
        )
        assert sampled_trajectories(by_bytes) == sampled_trajectories(by_message) == typed[by_bytes.question_id]
    assert as_bytes.short_questions == as_messages.short_questions == 0


def test_bytes_reply_carries_what_was_added_byte_for_byte(replay_client, pool_name):
    original = full_trajectory("q", 0)
    replay_client.add(pool_name, [original])
    request = replay_pb2.SampleRequest(pool=pool_name, question_ids=["q"], m=1, trajectories_as_bytes=True)
    (payload,) = replay_client.stub.Sample(request, timeout=10).samples[0].trajectory_bytes
    assert payload == trajectory_to_proto(original).SerializeToString()


def test_corrupt_stored_payload_is_an_error_not_a_wrong_trajectory(replay_client, pool_name, replay):
    replay_client.add(pool_name, [full_trajectory("q", 0)])
    data_key = f"{pool_prefix(pool_name)}:q:q:data"
    (tid,) = replay.store.client.hkeys(data_key)
    replay.store.client.hset(data_key, tid, b"\xff\xff\xff garbage")
    with pytest.raises(ValueError, match="invalid trajectory for question 'q'"):
        replay_client.sample(pool_name, ["q"], m=1)
