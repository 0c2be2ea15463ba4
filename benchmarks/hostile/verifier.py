"""The verifier under hostile callers: small calls beside a big one and beside slow items (issue 31 item 2, issue 46
item 5), and HTTP scorers whose answers break the parser or drip in a byte at a time (issue 46 items 3-4)."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from hostile.common import Service, health_check_s, timed_max
from rlep.common.grpc_channel import make_channel
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc


def verifier_items() -> dict:
    """Item 2: small calls beside one big call, and the health check beside sixteen."""
    verifier = Service("verifier")
    stub = verifier_pb2_grpc.VerifierStub(make_channel(verifier.address))
    serial = iter(range(10**9))

    def request(items: int) -> verifier_pb2.VerifyRequest:  # never-seen items: no cache answers them
        first = next(serial) * 10_000
        return verifier_pb2.VerifyRequest(
            items=[
                verifier_pb2.VerifyItem(
                    response=f"\\boxed{{\\frac{{{i}}}{{7}}+\\sqrt{{{i + 1}}}}}", ground_truth=f"{i}/7"
                )
                for i in range(first, first + items)
            ]
        )

    try:
        big = stub.Verify.future(request(4000))
        time.sleep(2.0)  # the big call's items are on the workers (a measurement pause)
        small = [timed_max(lambda: stub.Verify(request(1), timeout=5), times=1) for _ in range(3)]
        big_still_running = not big.done()
        big.cancel()
        calls = [stub.Verify.future(request(400)) for _ in range(16)]
        time.sleep(1.0)
        refused = Counter(c.exception().code().name for c in calls if c.done())
        health = timed_max(lambda: health_check_s(verifier.address))
        for call in calls:
            call.cancel()
        slow_items = [  # each ends TIMEOUT after ~2.6 s of a worker's CPU
            verifier_pb2.VerifyItem(response=f"\\boxed{{10^{{10^{{10^{{10^{{{k + 2}}}}}}}}}}}", ground_truth="1")
            for k in range(40)
        ]
        slow = stub.Verify.future(verifier_pb2.VerifyRequest(items=slow_items))
        time.sleep(1.0)  # issue 46 item 5's case: three 1-item calls 1 s into a call of 40 slow items
        beside_slow: list[float | str] = []
        for _ in range(3):
            started = time.perf_counter()
            try:
                stub.Verify(request(1), timeout=5)
                beside_slow.append(round(time.perf_counter() - started, 3))
            except grpc.RpcError as err:
                beside_slow.append(err.code().name)
        slow.cancel()
    finally:
        verifier.stop()
    return {
        "2 one-item calls beside a 4,000-item call": {
            "answered_in_s": small,
            "big_call_still_running": big_still_running,
        },
        "46.5 one-item calls (5 s deadlines) beside 40 slow items": {"answered_in_s_or_code": beside_slow},
        "2 health beside sixteen 400-item calls": {"health_max_s": health, "refused_at_once": dict(refused)},
    }


def hostile_scorer(answers: dict[str, tuple[bytes, bytes]]) -> str:
    """A raw HTTP/1.0 scorer on loopback: per path, bytes sent at once and bytes then dripped one per 0.5 s."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request and (chunk := conn.recv(65_536)):
                request += chunk
            at_once, dripped = answers[request.split()[1].decode()]
            try:
                conn.sendall(at_once)
                for byte in dripped:
                    time.sleep(0.5)
                    conn.sendall(bytes([byte]))
            except OSError:  # the verifier hung up
                pass

    def accept() -> None:
        while True:
            threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def scorer_items() -> dict:
    """Issue 46 items 3 and 4: answers that break the parser, and an answer's head dripped a byte per 0.5 s."""

    def reply(body: bytes) -> bytes:
        return b"HTTP/1.0 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)

    url = hostile_scorer(
        {"/overflow": (reply(b"1" + b"0" * 400), b""), "/deep": (reply(b"[" * 5000), b""), "/drip": (b"", reply(b"1"))}
    )
    sets = [
        f"scorers.{name}.{key}={value}"
        for name in ("overflow", "deep", "drip")
        for key, value in [
            ("type", "http"),
            ("url", f"{url}/{name}"),
            ("timeout_s", 2),
            ("retries", 1),
            ("backoff_s", 0.1),
        ]
    ]
    verifier = Service("verifier", *sets)  # default max_calls_in_flight: 14 hung calls took every slot
    stub = verifier_pb2_grpc.VerifierStub(make_channel(verifier.address))

    def call(source: str, timeout: float) -> tuple[str, float]:
        item = verifier_pb2.VerifyItem(response="\\boxed{2}", ground_truth="2", data_source=source)
        started = time.perf_counter()
        try:
            [result] = stub.Verify(verifier_pb2.VerifyRequest(items=[item]), timeout=timeout).results
            outcome = result.DESCRIPTOR.fields_by_name["verdict"].enum_type.values_by_number[result.verdict].name
        except grpc.RpcError as err:
            outcome = err.code().name
        return outcome, round(time.perf_counter() - started, 3)

    try:
        with ThreadPoolExecutor(24) as threads:
            bad = [threads.submit(call, ("overflow", "deep")[i % 2], 60) for i in range(14)]
            math = [threads.submit(call, "", 5) for _ in range(10)]
            bad_outcomes, math_outcomes = [f.result() for f in bad], [f.result() for f in math]
        drip = call("drip", 60)
    finally:
        verifier.stop()
    return {
        "46.3 fourteen calls answered 1e400-as-int or 5,000 '[', beside ten math calls": {
            "bad_calls": dict(Counter(o for o, _ in bad_outcomes)),
            "bad_calls_max_s": max(s for _, s in bad_outcomes),
            "math_calls": dict(Counter(o for o, _ in math_outcomes)),
            "math_calls_max_s": max(s for _, s in math_outcomes),
        },
        "46.4 answer head dripped 1 byte / 0.5 s (timeout_s 2, 1 retry)": {"verdict": drip[0], "seconds": drip[1]},
    }
