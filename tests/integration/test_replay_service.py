"""The replay pool as the learner sees it: a real gRPC server over a real Redis."""

from __future__ import annotations

import grpc
import pytest

from rlep.common.grpc_channel import make_channel
from rlep.common.types import Source, Trajectory, Verdict
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.services.replay.sampling import Strategy
from rlep.services.replay.types import PoolNotFound

pytestmark = pytest.mark.integration


def success(qid: str, i: int, version: int = 0, tokens: int = 4) -> Trajectory:
    return Trajectory(
        qid,
        f"solution {i} of {qid} \\boxed{{{i}}}",
        reward=1.0,
        source=Source.FRESH,
        verdict=Verdict.CORRECT,
        policy_version=version,
        response_token_ids=tuple(range(i, i + tokens)),
    )


def test_add_is_idempotent_and_reports_outcomes(replay_client, pool_name):
    batch = [success("q1", i) for i in range(3)]
    wrong = Trajectory("q1", "nope", reward=-1.0, verdict=Verdict.WRONG)
    first = replay_client.add(pool_name, [*batch, wrong, batch[0]])
    assert (first.added, first.duplicate, first.rejected) == (3, 1, 1)
    assert first.rejections[0].index == 3 and "not a success" in first.rejections[0].reason
    again = replay_client.add(pool_name, batch)  # a retried request
    assert (again.added, again.duplicate) == (0, 3)
    assert replay_client.stats(pool_name).trajectories == 3


def test_sample_m_distinct_per_question_deterministic_for_a_seed(replay_client, pool_name):
    replay_client.add(pool_name, [success(f"q{q}", i) for q in range(5) for i in range(6)])
    replay_client.add(pool_name, [success("short", 0)])
    qids = [f"q{q}" for q in range(5)] + ["short", "absent"]
    first = replay_client.sample(pool_name, qids, m=2, seed=7)
    assert [len(first[q]) for q in qids] == [2, 2, 2, 2, 2, 1, 0]
    for q in qids[:5]:
        texts = [t.response_text for t in first[q]]
        assert len(set(texts)) == 2 and all(f"of {q} " in t for t in texts)
    assert replay_client.sample(pool_name, qids, m=2, seed=7) == first
    reordered = replay_client.sample(pool_name, list(reversed(qids)), m=2, seed=7)
    assert reordered == first  # per-question draws do not depend on the rest of the request
    others = [replay_client.sample(pool_name, qids, m=2, seed=s) for s in range(8, 14)]
    assert any(o != first for o in others)


def test_uniform_sampling_covers_every_success(replay_client, pool_name):
    replay_client.add(pool_name, [success("q", i) for i in range(6)])
    seen = {t.response_text for s in range(60) for t in replay_client.sample(pool_name, ["q"], m=2, seed=s)["q"]}
    assert len(seen) == 6


def test_recency_and_staleness_bound(replay_client, pool_name):
    replay_client.add(pool_name, [success("q", i, version=i) for i in range(6)])
    recent = replay_client.sample(pool_name, ["q"], m=2, strategy=Strategy.RECENCY)["q"]
    assert [t.policy_version for t in recent] == [5, 4]
    bounded = replay_client.sample(pool_name, ["q"], m=6, min_policy_version=4, seed=1)["q"]
    assert sorted(t.policy_version for t in bounded) == [4, 5]


def test_prioritized_follows_priorities(replay_client, pool_name, replay):
    replay_client.add(pool_name, [success("q", i) for i in range(4)])
    favourite = success("q", 2)
    stub = replay_client.stub
    reply = stub.UpdatePriorities(
        replay_pb2.UpdatePrioritiesRequest(
            pool=pool_name,
            updates=[
                replay_pb2.PriorityUpdate(question_id="q", priority=0.001),
                replay_pb2.PriorityUpdate(question_id="q", trajectory_id=favourite.id, priority=1000.0),
                replay_pb2.PriorityUpdate(question_id="q", trajectory_id="f" * 64, priority=1.0),
            ],
        ),
        timeout=10,
    )
    assert (reply.updated, reply.missing) == (5, 1)
    picks = [
        replay_client.sample(pool_name, ["q"], m=1, strategy=Strategy.PRIORITIZED, seed=s)["q"][0] for s in range(20)
    ]
    assert sum(p.response_text == favourite.response_text for p in picks) >= 18


def test_diverse_prefers_dissimilar_responses(replay_client, pool_name):
    near = [
        Trajectory("q", f"near {i}", 1.0, verdict=Verdict.CORRECT, response_token_ids=(1, 2, 3, 4, 5, 6 + i))
        for i in range(4)
    ]
    far = Trajectory("q", "far", 1.0, verdict=Verdict.CORRECT, response_token_ids=(50, 51, 52, 53))
    replay_client.add(pool_name, [*near, far])
    for seed in range(5):
        picked = replay_client.sample(pool_name, ["q"], m=2, strategy=Strategy.DIVERSE, seed=seed)["q"]
        assert "far" in {t.response_text for t in picked}


def test_capacity_evicts_oldest(replay_client, pool_name, replay):
    replay_client.add(pool_name, [success("q", i) for i in range(10)])  # capacity 8 in the fixture
    stats = replay_client.stats(pool_name)
    assert stats.trajectories == 8 and stats.capacity_per_question == 8
    kept = {t.response_text for t in replay_client.sample(pool_name, ["q"], m=8, seed=0)["q"]}
    assert kept == {success("q", i).response_text for i in range(2, 10)}


def test_stats_describe_the_pool(replay_client, pool_name):
    replay_client.add(
        pool_name, [success(f"q{q}", i, version=q % 2, tokens=2 + i) for q in range(3) for i in range(q + 1)]
    )
    stats = replay_client.stats(pool_name)
    assert (stats.questions, stats.trajectories) == (3, 6)
    assert {b.label: b.count for b in stats.successes_per_question} == {"1": 1, "2": 1, "3": 1}
    assert {b.label: b.count for b in stats.per_policy_version} == {"0": 4, "1": 2}
    lengths = [2, 2, 3, 2, 3, 4]
    assert stats.mean_response_tokens == pytest.approx(sum(lengths) / 6)
    assert {b.label: b.count for b in stats.response_token_histogram} == {"2-3": 5, "4-7": 1}
    assert stats.payload_bytes > 0 and stats.redis_used_memory_bytes > 0
    assert pool_name in replay_client.list_pools()


def test_export_then_import_gives_identical_pool(replay_client, pool_name):
    questions = [
        replay_pb2.Question(
            question_id=f"q{q}",
            ground_truth=str(q),
            data_source="unit",
            prompt=[replay_pb2.ChatMessage(role="user", content=f"what is {q}?")],
        )
        for q in range(30)
    ]
    replay_client.add(
        pool_name, [success(f"q{q}", i, version=i) for q in range(30) for i in range(q % 4 + 1)], questions
    )
    chunks = list(replay_client.export(pool_name, questions_per_chunk=7))
    assert len(chunks) == 5
    copy = pool_name + "-copy"
    for chunk in chunks:
        chunk.pool = copy
    try:
        reply = replay_client.import_chunks(chunks)
        assert reply.added == replay_client.stats(pool_name).trajectories and reply.rejected == 0
        original, imported = replay_client.stats(pool_name), replay_client.stats(copy)
        for field in (
            "questions",
            "trajectories",
            "successes_per_question",
            "per_policy_version",
            "mean_response_tokens",
            "response_token_histogram",
            "payload_bytes",
        ):
            assert getattr(original, field) == getattr(imported, field), field
        assert list(replay_client.export(copy, 7))[0].questions == chunks[0].questions
        qids = [f"q{q}" for q in range(30)]
        assert replay_client.sample(copy, qids, m=4, seed=3) == replay_client.sample(pool_name, qids, m=4, seed=3)
    finally:
        replay_client.drop(copy, confirm=copy)


def _abort_code(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize(
    ("request_fields", "code", "phrase"),
    [
        ({"pool": "no-such-pool", "question_ids": ["q"], "m": 2}, grpc.StatusCode.NOT_FOUND, "unknown pool"),
        ({"pool": "bad name!", "question_ids": ["q"], "m": 2}, grpc.StatusCode.INVALID_ARGUMENT, "must match"),
        ({"question_ids": ["q"], "m": 0}, grpc.StatusCode.INVALID_ARGUMENT, "m must be in"),
        ({"question_ids": ["q"], "m": 100_000}, grpc.StatusCode.INVALID_ARGUMENT, "m must be in"),
        ({"question_ids": [], "m": 2}, grpc.StatusCode.INVALID_ARGUMENT, "question_ids is empty"),
        ({"question_ids": [f"q{i}" for i in range(100_000)], "m": 2}, grpc.StatusCode.INVALID_ARGUMENT, "over 50000"),
    ],
)
def test_bad_sample_requests(replay_client, pool_name, request_fields, code, phrase):
    replay_client.add(pool_name, [success("q", 0)])
    fields = {"pool": pool_name, **request_fields}
    got_code, details = _abort_code(replay_client.stub.Sample, replay_pb2.SampleRequest(**fields))
    assert got_code == code and phrase in details


def test_large_sample_request_works(replay_client, pool_name):
    replay_client.add(pool_name, [success(f"q{q}", i) for q in range(200) for i in range(3)])
    qids = [f"q{q % 300}" for q in range(40_000)]  # repeated ids: each distinct one is drawn once
    reply = replay_client.stub.Sample(replay_pb2.SampleRequest(pool=pool_name, question_ids=qids, m=1), timeout=60)
    assert len(reply.samples) == 40_000 and reply.samples[0].available == 3 and reply.samples[250].available == 0
    assert reply.samples[0].trajectories == reply.samples[300].trajectories


def test_bad_trajectories_are_rejected_with_reasons(replay_client, pool_name, replay):
    good = trajectory_pb2.Trajectory(question_id="q", response_text="ok", verdict=trajectory_pb2.CORRECT)
    cases = [
        trajectory_pb2.Trajectory(response_text="x", verdict=trajectory_pb2.CORRECT),
        trajectory_pb2.Trajectory(question_id="q", verdict=trajectory_pb2.CORRECT),
        trajectory_pb2.Trajectory(question_id="q", response_text="y" * 2_000_000, verdict=trajectory_pb2.CORRECT),
        trajectory_pb2.Trajectory(
            question_id="q",
            response_text="z",
            verdict=trajectory_pb2.CORRECT,
            response_token_ids=[1, 2],
            behavior_logprobs=[-0.1],
        ),
        trajectory_pb2.Trajectory(question_id="q" * 300, response_text="w", verdict=trajectory_pb2.CORRECT),
        *(
            trajectory_pb2.Trajectory(
                question_id="q",
                response_text=f"v{value}",
                verdict=trajectory_pb2.CORRECT,
                response_token_ids=[1, 2],
                behavior_logprobs=[-0.1, value],
            )
            for value in (float("nan"), float("-inf"))
        ),
    ]
    reply = replay_client.stub.AddTrajectories(
        replay_pb2.AddTrajectoriesRequest(pool=pool_name, trajectories=[good, *cases]), timeout=10
    )
    assert (reply.added, reply.rejected) == (1, 7)
    reasons = [r.reason for r in reply.rejections]
    phrases = ("missing question_id", "missing response_text", "oversize", "differ in length", "longer than")
    for phrase in phrases:
        assert any(phrase in r for r in reasons), phrase
    assert sum("behavior_logprobs must be finite" in r for r in reasons) == 2


def test_non_utf8_is_invalid_argument(replay, auth_token_file):
    channel = make_channel(f"127.0.0.1:{replay.port}", auth_token_file.read_text().strip())
    call = channel.unary_unary("/rlep.replay.v1.ReplayBuffer/AddTrajectories")
    pool = b"\x0a\x01p"
    trajectory = b"\x0a\x01q" + b"\x22\x02\xc3\x28"  # question_id "q", response_text = invalid UTF-8
    payload = pool + b"\x12" + bytes([len(trajectory)]) + trajectory
    with pytest.raises(grpc.RpcError) as err:
        call(payload, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_drop_needs_confirmation(replay_client, pool_name):
    replay_client.add(pool_name, [success("q", i) for i in range(3)])
    with pytest.raises(grpc.RpcError) as err:
        replay_client.drop(pool_name, confirm="yes")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert replay_client.drop(pool_name, confirm=pool_name) == 3
    assert pool_name not in replay_client.list_pools()
    code, _ = _abort_code(replay_client.stub.GetPoolStats, replay_pb2.GetPoolStatsRequest(pool=pool_name))
    assert code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(PoolNotFound) as missing:  # the client's typed error, what the learner catches
        replay_client.sample(pool_name, ["q"], m=1)
    assert missing.value.args == (pool_name,)


def test_wrong_token_is_unauthenticated(replay):
    stub = replay_pb2_grpc.ReplayBufferStub(make_channel(f"127.0.0.1:{replay.port}", "wrong"))
    code, _ = _abort_code(stub.ListPools, replay_pb2.ListPoolsRequest())
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_lua_uniform_draw_matches_its_python_reference(replay_client, pool_name):
    from rlep.services.replay.sampling import choose_uniform_indices, question_stream_seed

    batch = [success("q", i) for i in range(7)]
    replay_client.add(pool_name, batch)
    by_rank = sorted(t.id for t in batch)  # one policy version: Redis orders the ZSET by member
    for seed in range(10):
        expected = [by_rank[i] for i in choose_uniform_indices(7, 3, question_stream_seed(seed, "q"))]
        assert [t.id for t in replay_client.sample(pool_name, ["q"], m=3, seed=seed)["q"]] == expected


def test_metrics_count_adds_and_samples(replay_client, pool_name, replay, auth_token_file):
    from tests.metrics_util import scrape, series_value, service_labels

    token = auth_token_file.read_text().strip()
    series = {
        "added": 'rlep_replay_trajectories_added_total{outcome="added"}',
        "duplicate": 'rlep_replay_trajectories_added_total{outcome="duplicate"}',
        "samples": "rlep_replay_sample_seconds_count",
        "sampled": "rlep_replay_sampled_trajectories_total",
        "ok": 'rlep_replay_requests_total{code="OK",method="Sample"}',
        "invalid": 'rlep_replay_requests_total{code="INVALID_ARGUMENT",method="Sample"}',
    }
    text = scrape(replay.metrics_port, token)
    before = {name: _value_or_zero(text, s) for name, s in series.items()}
    replay_client.add(pool_name, [success("q", i) for i in range(3)])
    replay_client.add(pool_name, [success("q", 0)])
    replay_client.sample(pool_name, ["q"], m=2, seed=0)
    _abort_code(replay_client.stub.Sample, replay_pb2.SampleRequest(pool=pool_name, question_ids=["q"], m=0))
    replay_client.stats(pool_name)

    text = scrape(replay.metrics_port, token)
    assert service_labels(text) == {"replay"}
    assert series_value(text, f'rlep_replay_pool_trajectories{{pool="{pool_name}"}}') == 3.0
    after = {name: series_value(text, s) for name, s in series.items()}
    # Other tests share this server: compare deltas (pytest runs one test at a time).
    deltas = {name: after[name] - before[name] for name in series}
    assert deltas == {"added": 3, "duplicate": 1, "samples": 1, "sampled": 2, "ok": 1, "invalid": 1}


def _value_or_zero(text: str, series: str) -> float:
    from tests.metrics_util import series_value

    try:
        return series_value(text, series)
    except AssertionError:  # a labelled series appears only once it has been counted
        return 0.0


def test_metrics_need_the_token(replay, auth_token_file):
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{replay.metrics_port}/metrics"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
        assert err.value.code == 401
    token = auth_token_file.read_text().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200 and b"rlep_replay_requests_total" in reply.read()


def test_a_client_with_an_outage_budget_rides_out_a_replay_restart(redis_url, auth_token_file, pool_name):
    """The learner's replay client (endpoints.service_outage_s) waits for a restarting replay, not fails."""
    import logging
    import threading

    from rlep.common.config import ServerConfig
    from rlep.common.ports import free_port
    from rlep.services.replay.client import ReplayClient
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.replay.main import start_replay

    config = ReplayConfig(server=ServerConfig(port=free_port(), auth_token_file=auth_token_file), redis_url=redis_url)
    address, token = f"127.0.0.1:{config.server.port}", auth_token_file.read_text().strip()
    first = start_replay(config)
    patient = ReplayClient(address, token=token, outage_s=60.0)
    patient.add(pool_name, [success("q", i) for i in range(3)])
    first.stop()

    with ReplayClient(address, token=token) as impatient, pytest.raises(grpc.RpcError) as failure:
        impatient.stats(pool_name)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE

    # Each retry is logged: the server comes back when the patient call has failed once and is waiting.
    retrying = threading.Event()

    class OnRetry(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying in" in record.getMessage():
                retrying.set()

    handler = OnRetry()
    logging.getLogger("rlep.common.grpc_retry").addHandler(handler)
    answer: list = []
    caller = threading.Thread(target=lambda: answer.append(patient.stats(pool_name)))
    try:
        caller.start()
        assert retrying.wait(30), "the call did not retry a server that was down"
        second = start_replay(config)
        caller.join(60)
        assert not caller.is_alive(), "the call did not return after the server came back"
        assert answer and answer[0].trajectories == 3
        second.stop()
    finally:
        logging.getLogger("rlep.common.grpc_retry").removeHandler(handler)
        patient.close()


def tool_trace(qid: str, i: int) -> Trajectory:
    """A multi-turn tool episode as the learner stores it (issue 50): ids, mask, NaN logprobs on the tool's tokens."""
    from rlep.common.types import ToolCall

    nan = float("nan")
    return Trajectory(
        qid,
        f"<code>print({i})</code><output>\n{i}\n</output>\\boxed{{{i}}}",
        reward=1.0,
        verdict=Verdict.CORRECT,
        policy_version=3,
        response_token_ids=(10 + i, 11, 12, 13, 14),
        behavior_logprobs=(-0.5, -0.25, nan, nan, -0.125),
        response_mask=(1, 1, 0, 0, 1),
        tokenizer_fingerprint="t" * 16,
        chat_template_hash="c" * 32,
        tool_env_hash="e" * 32,
        tool_calls=(ToolCall(f"print({i})", "ok", 0, f"{i}\n", "", 0.02, False),),
        run_id="run-a",
    )


def test_a_tool_trace_is_stored_sampled_and_exported_whole(replay_client, pool_name):
    """Issue 50, part 3: the pool keeps a trace's mask, calls and hashes through add, Sample and export/import (the
    NaN logprobs of its tool tokens are accepted: no importance ratio reads them); a trace whose mask does not fit
    its ids is refused with its reason and stores nothing."""
    from rlep.common.wire import trajectory_to_proto

    traces = [tool_trace("q", i) for i in range(3)]
    bad = trajectory_to_proto(tool_trace("q", 9))
    del bad.response_mask[2:]  # what a client that is not rlep's could send
    request = replay_pb2.AddTrajectoriesRequest(pool=pool_name, trajectories=[*map(trajectory_to_proto, traces), bad])
    reply = replay_client.stub.AddTrajectories(request, timeout=10)
    assert (reply.added, reply.rejected) == (3, 1)
    assert "response_mask and response_token_ids differ in length" in reply.rejections[0].reason

    def whole(t: Trajectory) -> tuple:
        return (t.response_token_ids, t.response_mask, t.tool_calls, t.chat_template_hash, t.tool_env_hash)

    drawn = replay_client.sample(pool_name, ["q"], m=3, seed=1)["q"]
    assert sorted(map(whole, drawn)) == sorted(map(whole, traces))
    copy = pool_name + "-traces"
    chunks = list(replay_client.export(pool_name))
    for chunk in chunks:
        chunk.pool = copy
    try:
        assert replay_client.import_chunks(chunks).added == 3
        again = replay_client.sample(copy, ["q"], m=3, seed=1)["q"]
        assert sorted(map(whole, again)) == sorted(map(whole, traces))
    finally:
        replay_client.drop(copy, confirm=copy)
