"""What held must keep holding: replay `Sample` and verifier `Verify` throughput and p99 under many honest clients."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from hostile.common import Service
from hostile.replay import add_request, success
from rlep.common.grpc_channel import make_channel
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc


def load(seconds: float, work: Path) -> dict:
    """What held must keep holding: replay Sample from 16 clients, verifier from 8, for `seconds` each."""
    replay = Service("replay", data_dir=work / "load-redis")
    stub = replay_pb2_grpc.ReplayBufferStub(make_channel(replay.address))
    for q in range(256):
        stub.AddTrajectories(add_request("load", [success(f"q{q}", i) for i in range(8)]), timeout=10)
    ids = [f"q{q}" for q in range(256)]
    sample = replay_pb2.SampleRequest(pool="load", question_ids=ids[:64], m=2, trajectories_as_bytes=True)
    try:
        replay_figures = hammer(lambda s=stub: s.Sample(sample, timeout=10), 16, seconds, items_per_call=1)
    finally:
        replay.stop()
    verifier = Service("verifier")
    vstub = verifier_pb2_grpc.VerifierStub(make_channel(verifier.address))
    serial = iter(range(10**9))

    def batch() -> verifier_pb2.VerifyRequest:  # distinct items: the verdict cache answers none of them
        first = next(serial) * 64
        items = [
            verifier_pb2.VerifyItem(response=f"\\boxed{{{i}}}", ground_truth=str(i)) for i in range(first, first + 64)
        ]
        return verifier_pb2.VerifyRequest(items=items)

    try:
        verifier_figures = hammer(lambda: vstub.Verify(batch(), timeout=30), 8, seconds, items_per_call=64)
    finally:
        verifier.stop()
    return {"replay Sample, 16 clients": replay_figures, "verifier Verify (64 items), 8 clients": verifier_figures}


def hammer(call, clients: int, seconds: float, items_per_call: int) -> dict:
    latencies: list[float] = []
    errors = Counter()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                call()
                latencies.append(time.perf_counter() - started)
            except grpc.RpcError as err:
                errors[err.code().name] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else None
    return {
        "calls_per_s": round(len(latencies) / seconds, 1),
        "items_per_s": round(len(latencies) * items_per_call / seconds, 1),
        "p99_ms": round(p99 * 1000, 1) if p99 else None,
        "errors": dict(errors),
    }
