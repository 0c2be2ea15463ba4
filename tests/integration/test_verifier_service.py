"""The verifier as users see it: a real gRPC server on loopback running real math-verify workers."""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from rlep.common.grpc_channel import make_channel
from rlep.common.types import Verdict
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from tests.conftest import TEST_DATA, read_jsonl
from tests.metrics_util import series_value, service_labels

pytestmark = pytest.mark.integration

EQUIVALENT_FORMS = [  # (response, gold): different notation, same value
    ("The answer is $\\boxed{\\dfrac{1}{2}}$.", "0.5"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),
    ("so \\boxed{27}", "27.0"),
    ("\\boxed{033}", "33"),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("Answer: 2\\sqrt{2}", "\\sqrt{8}"),
    ("\\boxed{\\pi/4}", "\\frac{\\pi}{4}"),
    ("\\fbox{6}", "6"),
]
NOT_EQUIVALENT = [
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("\\boxed{28}", "27.0"),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}"),
    ("\\boxed{-6}", "6"),
]


def real_answer_pairs() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Right and wrong responses built from the 600 real AIME/AMC/MATH-500 gold answers in tests/data/."""
    right, wrong = [], []
    for name in ("aime24", "aime25", "amc23", "math500"):
        rows = read_jsonl(TEST_DATA / f"{name}.jsonl")
        answers = [str(r["answer"]) for r in rows]
        for gold in answers:
            right.append((f"Let me work it out step by step... so the result is $\\boxed{{{gold}}}$.", gold))
        integers = [a for a in answers if a.lstrip("-").isdigit()]
        for gold, other in zip(integers, integers[1:], strict=False):
            if int(gold) != int(other):
                wrong.append((f"Thus the answer is \\boxed{{{other}}}.", gold))
    return right, wrong


def fresh_correct_items(first: int, count: int) -> list[tuple[str, str]]:
    """Correct items whose (answer, gold) pairs no other test sends: the verdict cache cannot answer them."""
    return [(f"so \\boxed{{{i}/7}}", f"\\frac{{{i}}}{{7}}") for i in range(first, first + count)]


def test_real_answers_are_judged_right_and_wrong(verifier_client):
    right, wrong = real_answer_pairs()
    assert len(right) == 600 and len(wrong) > 300
    outcomes = verifier_client.verify(right + wrong)
    right_verdicts = [o.verdict for o in outcomes[: len(right)]]
    wrong_verdicts = [o.verdict for o in outcomes[len(right) :]]
    assert right_verdicts.count(Verdict.CORRECT) == len(right)
    assert wrong_verdicts.count(Verdict.WRONG) == len(wrong)
    assert {o.reward for o in outcomes[: len(right)]} == {1.0}
    assert {o.reward for o in outcomes[len(right) :]} == {-1.0}


def test_equivalent_notations_keep_request_order(verifier_client):
    items = [pair for both in zip(EQUIVALENT_FORMS, NOT_EQUIVALENT * 2, strict=False) for pair in both]
    expected = [v for _ in range(len(EQUIVALENT_FORMS)) for v in (Verdict.CORRECT, Verdict.WRONG)]
    outcomes = verifier_client.verify(items)
    assert [o.verdict for o in outcomes] == expected
    assert outcomes[0].extracted_answer == "\\dfrac{1}{2}"


def test_empty_batch_returns_no_results(verifier_client):
    assert verifier_client.verify([]) == []


BAD_INPUTS = {
    "empty strings": (("", ""), {Verdict.UNPARSEABLE}),
    "empty gold": (("\\boxed{3}", ""), {Verdict.GOLD_UNPARSEABLE}),
    "1 MB response": (("x" * 1_000_000 + "\\boxed{3}", "3"), {Verdict.CORRECT}),
    "1 MB without answer": (("y" * 1_000_000, "3"), {Verdict.UNPARSEABLE}),
    "1 MB boxed": (("\\boxed{" + "7" * 1_000_000 + "}", "7"), {Verdict.UNPARSEABLE}),
    "unbalanced boxed": (("so the answer is \\boxed{12", "12"), {Verdict.UNPARSEABLE}),
    "10k nested braces": (("\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}", "1"), {Verdict.UNPARSEABLE}),
    "power tower": (("\\boxed{10^{10^{10^{10}}}}", "5"), {Verdict.TIMEOUT, Verdict.WRONG}),
    "power tower gold": (("\\boxed{5}", "10^{10^{10^{10}}}"), {Verdict.TIMEOUT, Verdict.WRONG}),
    "huge factorial": (("\\boxed{9999999999!}", "3"), {Verdict.TIMEOUT, Verdict.WRONG}),
    "unparseable gold": (("\\boxed{3}", "\\\\\\\\"), {Verdict.GOLD_UNPARSEABLE}),
    "gold without expression": (("\\boxed{3}", "???"), {Verdict.GOLD_UNPARSEABLE}),
    "gold too long": (("\\boxed{3}", "3" * 10_000), {Verdict.GOLD_UNPARSEABLE}),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gets_a_verdict_within_the_timeout(verifier_client, verifier, name):
    item, allowed = BAD_INPUTS[name]
    started = time.monotonic()
    [outcome] = verifier_client.verify([item])
    assert outcome.verdict in allowed
    assert time.monotonic() - started < verifier.pool.item_timeout_s + 3.0


def test_throughput_holds_after_bad_inputs(verifier_client, verifier, auth_token_file):
    """Bad inputs cost only their own restarts: afterwards every worker is alive and takes its share again."""
    batch = fresh_correct_items(10_000, 200)
    restarts = "rlep_verifier_worker_restarts_total"
    pool = verifier.pool
    pids_before, restarts_before = pool.worker_pids, _metric(verifier, auth_token_file, restarts)
    bad = verifier_client.verify([item for item, _ in BAD_INPUTS.values()])
    timeouts = [o.verdict for o in bad].count(Verdict.TIMEOUT)
    # At most one restart per TIMEOUT (the worker's CPU limit ends some checks itself), none for the rest,
    # and the replaced processes are gone (none left burning a core).
    bad_restarts = _metric(verifier, auth_token_file, restarts) - restarts_before
    assert bad_restarts <= timeouts
    for pid in set(pids_before) - set(pool.worker_pids):
        assert not os.path.exists(f"/proc/{pid}")
    before = pool.counts()
    outcomes = verifier_client.verify(batch)
    after = pool.counts()
    assert all(o.verdict == Verdict.CORRECT for o in outcomes)
    assert _metric(verifier, auth_token_file, restarts) == restarts_before + bad_restarts  # none on good input
    assert after["checked"] - before["checked"] == len(batch) and after["resent"] == before["resent"]
    shares = [a - b for a, b in zip(after["checked_by_worker"], before["checked_by_worker"], strict=True)]
    # Both workers work: none was left dead or stuck (it would check nothing). Not an even split: a replaced
    # worker starts with cold sympy/math-verify caches, so its first items are slower (measured 45 of 200 in a
    # full suite run on 2 busy cores, ~100 alone).
    assert min(shares) >= len(batch) // 10, shares


def test_worker_killed_mid_batch_loses_no_item(verifier_client, verifier, auth_token_file):
    crashes = 'rlep_verifier_worker_restarts_total{reason="crash"}'
    restarts_before = _metric(verifier, auth_token_file, crashes)
    resent_before = verifier.pool.counts()["resent"]
    future_batch = fresh_correct_items(20_000, 1500)
    result: list = []
    thread = threading.Thread(target=lambda: result.extend(verifier_client.verify(future_batch)))
    thread.start()
    assert verifier.pool.wait_busy(0, timeout_s=30)  # worker 0 holds items of the batch
    os.kill(verifier.pool.worker_pids[0], 9)
    thread.join(timeout=120)
    assert [o.verdict for o in result] == [Verdict.CORRECT] * len(future_batch)
    assert _metric(verifier, auth_token_file, crashes) == restarts_before + 1
    # The killed worker had items in its pipe; they were sent again to its replacement, not lost.
    assert verifier.pool.counts()["resent"] > resent_before


def _raw_verify(port: int, token: str | None, payload: bytes) -> bytes:
    channel = make_channel(f"127.0.0.1:{port}", token)
    call = channel.unary_unary("/rlep.verifier.v1.Verifier/Verify")  # raw bytes in and out
    try:
        return call(payload, timeout=10)
    finally:
        channel.close()


def test_invalid_utf8_is_invalid_argument(verifier, auth_token_file):
    item = b"\x0a\x02\xff\xfe"  # VerifyItem.response = b"\xff\xfe", not UTF-8
    payload = b"\x0a" + bytes([len(item)]) + item
    with pytest.raises(grpc.RpcError) as err:
        _raw_verify(verifier.port, auth_token_file.read_text().strip(), payload)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "VerifyRequest" in err.value.details()


def test_too_many_items_and_too_many_bytes_are_invalid_argument(verifier, auth_token_file):
    stub = verifier_pb2_grpc.VerifierStub(
        make_channel(f"127.0.0.1:{verifier.port}", auth_token_file.read_text().strip())
    )
    too_many = verifier_pb2.VerifyRequest(items=[verifier_pb2.VerifyItem(response="1", ground_truth="1")] * 1001)
    too_big = verifier_pb2.VerifyRequest(
        items=[verifier_pb2.VerifyItem(response="z" * 3_000_000, ground_truth="1")] * 3
    )
    for request, phrase in ((too_many, "over the limit of 1000"), (too_big, "bytes, over the limit")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert phrase in err.value.details()


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_auth_is_required(verifier, token):
    stub = verifier_pb2_grpc.VerifierStub(make_channel(f"127.0.0.1:{verifier.port}", token))
    with pytest.raises(grpc.RpcError) as err:
        stub.Verify(verifier_pb2.VerifyRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_answers_without_token_and_reflection_lists_methods(verifier, auth_token_file):
    channel = make_channel(f"127.0.0.1:{verifier.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "rlep.verifier.v1.Verifier"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    authed = make_channel(f"127.0.0.1:{verifier.port}", auth_token_file.read_text().strip())
    database = ProtoReflectionDescriptorDatabase(authed)
    assert "rlep.verifier.v1.Verifier" in database.get_services()
    methods = [m.name for m in database.FindFileContainingSymbol("rlep.verifier.v1.Verifier").service[0].method]
    assert methods == ["Verify"]


def _scrape(verifier, token: str | None) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{verifier.metrics_port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=5) as reply:
        return reply.read().decode()


def _metric(verifier, token_file, series: str) -> float:
    return series_value(_scrape(verifier, token_file.read_text().strip()), series)


def test_metrics_need_the_token_and_count_verdicts(verifier, verifier_client, auth_token_file):
    with pytest.raises(urllib.error.HTTPError) as err:
        _scrape(verifier, None)
    assert err.value.code == 401
    correct = 'rlep_verifier_items_total{verdict="correct",scorer="default"}'
    calls = 'rlep_verifier_requests_total{code="OK"}'
    before = _metric(verifier, auth_token_file, correct)
    calls_before = _metric(verifier, auth_token_file, calls)
    seconds_before = _metric(verifier, auth_token_file, "rlep_verifier_request_seconds_count")
    items_before = _metric(verifier, auth_token_file, "rlep_verifier_item_seconds_count")
    verifier_client.verify([("\\boxed{2}", "2")] * 3)
    assert _metric(verifier, auth_token_file, correct) == before + 3
    text = _scrape(verifier, auth_token_file.read_text().strip())
    assert _metric(verifier, auth_token_file, calls) == calls_before + 1
    assert _metric(verifier, auth_token_file, "rlep_verifier_request_seconds_count") == seconds_before + 1
    assert _metric(verifier, auth_token_file, "rlep_verifier_item_seconds_count") == items_before + 3
    assert series_value(text, "rlep_verifier_workers") == 2
    assert series_value(text, "rlep_verifier_items_in_flight") == 0
    assert service_labels(text) == {"verifier"}
