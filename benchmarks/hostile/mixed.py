"""Issue 46's mixed load: 64 hostile callers at once against replay and the verifier (~60 MB `AddTrajectories` and
`Verify` messages, exports nobody reads, imports trickling empty chunks, and plain calls in tight loops), beside one
legitimate client (the project's own clients, with their retries) and a health prober of both services.

Records the slowest health check per service, the legitimate client's successes out of its calls, and the growth of
each service's resident memory, each against its bound. The hostile callers run in a process of their own, as real
ones do: they do not share the prober's and the legitimate client's GIL.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from hostile.common import Service, checked, health_check_s
from hostile.replay import Trickle, add_request, success
from rlep.common.grpc_retry import call_with_retry
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.services.replay.client import ReplayClient
from rlep.services.verifier.client import VerifierClient
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc

# Longer than stream_idle_timeout_s (30 s), so unread exports and tricklers are each cancelled at least once.
MIXED_S = 45.0
BIG_BYTES = 60_000_000  # one big message: within max_request_bytes (64 MiB), two fill max_inflight_request_bytes
# Hostile callers by kind, 64 in all.
CALLERS = {
    "replay: 60 MB AddTrajectories": 8,
    "replay: ExportPool never read": 8,
    "replay: ImportPool trickling empty chunks": 8,
    "replay: Sample / ListPools / small adds": 16,
    "verifier: 60 MB Verify": 8,
    "verifier: 8-item Verify": 16,
}
# What the prober checks: each service's health on its data port and on its health port (`--health-port`).
PROBED = ("replay health", "replay health port", "verifier health", "verifier health port")
LEGIT_TIMEOUT_S = 10.0  # the legitimate client's deadline per attempt (its client retries UNAVAILABLE, deadlines)
PROBE_EVERY_S, PROBE_TIMEOUT_S = 0.1, 5.0
# What each service may hold beyond its idle size (ServerConfig defaults): the bytes of requests being handled
# (max_inflight_request_bytes, 128 MiB), their parsed copies as much again, and what gRPC receives before a handler
# sees it: each of the 16 threads a message of up to 64 MiB (max_request_bytes), twice over (bytes, parsed).
RSS_GROWTH_BOUND_MB = (2 * (128 << 20) + 16 * 2 * (64 << 20)) / 1e6


def mixed(work: Path) -> dict:
    replay = Service("replay", data_dir=work / "mixed-redis", health_port=True)
    verifier = Service("verifier", health_port=True)
    try:
        prepare_pools(replay.address)
        figures = run_beside_probes(replay, verifier)
    finally:
        replay.stop()
        verifier.stop()
    # The bound is on the health port, where probes go; the data port's own health check is measured beside it.
    bounds = {
        "replay health port max_s": 1.0,
        "verifier health port max_s": 1.0,
        "replay health port probes failed": 0,
        "verifier health port probes failed": 0,
        "replay health probes failed": 0,
        "verifier health probes failed": 0,
        "legitimate calls failed": 0,
        "replay rss_growth_mb": RSS_GROWTH_BOUND_MB,
        "verifier rss_growth_mb": RSS_GROWTH_BOUND_MB,
    }
    return {"46.12 64 hostile callers beside a legitimate client and health probes": checked(figures, bounds)}


def prepare_pools(address: str) -> None:
    """`mixed`: 64 questions x 8 small successes for plain calls; `mixed-export`: 20 MB for exports to stall on."""
    with ReplayClient(address) as client:
        for q in range(64):
            client.stub.AddTrajectories(add_request("mixed", [success(f"q{q}", i) for i in range(8)]), timeout=30)
        for q in range(40):
            rows = [success(f"q{q}", i, response_text=f"{i} " + "x" * 65536) for i in range(8)]
            client.stub.AddTrajectories(add_request("mixed-export", rows), timeout=30)


def run_beside_probes(replay: Service, verifier: Service) -> dict:
    """The hostile process for MIXED_S, the legitimate client and the prober meanwhile; their figures."""
    rss_before = {"replay": replay.rss_mb(), "verifier": verifier.rss_mb()}
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: gRPC does not survive a fork
    outcomes = spawn.Queue()
    hostile = spawn.Process(target=hostile_callers, args=(replay.address, verifier.address, MIXED_S, outcomes))
    stop = threading.Event()
    probes: dict[str, list[float]] = {name: [] for name in PROBED}
    rss_peak, failed = dict(rss_before), Counter()
    legit: dict = {}
    threads = [
        threading.Thread(target=probe, args=(replay, verifier, stop, probes, failed, rss_peak)),
        threading.Thread(target=legitimate_client, args=(replay.address, verifier.address, stop, legit)),
    ]
    hostile.start()
    for thread in threads:
        thread.start()
    hostile_outcomes = outcomes.get(timeout=MIXED_S + 300)
    hostile.join(timeout=60)
    stop.set()
    for thread in threads:
        thread.join()
    time.sleep(5.0)  # what is still held once the callers have gone (a measurement pause)
    figures: dict = {"seconds": MIXED_S, "hostile callers": hostile_outcomes}
    for probed in PROBED:
        ordered = sorted(probes[probed])
        figures[f"{probed} probes"] = len(ordered)
        figures[f"{probed} median_s"] = round(ordered[len(ordered) // 2], 3)
        figures[f"{probed} max_s"] = round(ordered[-1], 3)
        figures[f"{probed} probes failed"] = failed[probed]
    for name, service in (("replay", replay), ("verifier", verifier)):
        figures[f"{name} rss_before_mb (own, with children)"] = [round(v, 1) for v in rss_before[name]]
        figures[f"{name} rss_growth_mb"] = round(rss_peak[name][0] - rss_before[name][0], 1)
        figures[f"{name} rss_growth_with_children_mb"] = round(rss_peak[name][1] - rss_before[name][1], 1)
        figures[f"{name} rss_growth_5s_after_mb"] = round(service.rss_mb()[0] - rss_before[name][0], 1)
    figures.update(legit)
    return figures


def probe(
    replay: Service, verifier: Service, stop: threading.Event, probes: dict, failed: Counter, rss_peak: dict
) -> None:
    """Checks both services' health, on the data port and on the health port, every PROBE_EVERY_S (a check that
    fails counts as its whole 5-s deadline, and in `failed`) and samples their resident memory."""
    while not stop.wait(PROBE_EVERY_S):
        for name, service in (("replay", replay), ("verifier", verifier)):
            addresses = {f"{name} health": service.address, f"{name} health port": service.health_address}
            for probed, address in addresses.items():
                try:
                    took = health_check_s(address, timeout=PROBE_TIMEOUT_S)
                except grpc.RpcError:
                    took = None
                probes[probed].append(PROBE_TIMEOUT_S if took is None else took)
                failed[probed] += took is None
            own, total = service.rss_mb()
            rss_peak[name] = (max(rss_peak[name][0], own), max(rss_peak[name][1], total))


def legitimate_client(replay_address: str, verifier_address: str, stop: threading.Event, out: dict) -> None:
    """Ordinary calls in turn, as a trainer makes them, with the project's clients: each must succeed."""
    outcomes: Counter = Counter()
    worst = 0.0
    with (
        ReplayClient(replay_address, timeout_s=LEGIT_TIMEOUT_S) as replay,
        VerifierClient(verifier_address, timeout_s=LEGIT_TIMEOUT_S) as verifier,
    ):
        calls = [
            lambda n: replay.list_pools(),
            lambda n: replay.sample("mixed", [f"q{q}" for q in range(n % 56, n % 56 + 8)], m=2),
            lambda n: call_with_retry(
                replay.stub.AddTrajectories, add_request("mixed", [success(f"legit{n}", n)]), LEGIT_TIMEOUT_S
            ),
            lambda n: replay.stats("mixed"),
            lambda n: verifier.verify([(f"so \\boxed{{{n + k}}}", str(n + k)) for k in range(4)]),
        ]
        n = 0
        while not stop.is_set():
            started = time.perf_counter()
            try:
                calls[n % len(calls)](n)
                outcomes["OK"] += 1
            except grpc.RpcError as err:
                outcomes[err.code().name] += 1
            worst = max(worst, time.perf_counter() - started)
            n += 1
            stop.wait(0.1)
    out["legitimate calls"] = sum(outcomes.values())
    out["legitimate calls failed"] = sum(outcomes.values()) - outcomes["OK"]
    out["legitimate outcomes"] = dict(outcomes)
    out["legitimate call_max_s"] = round(worst, 3)


def hostile_callers(replay_address: str, verifier_address: str, seconds: float, outcomes) -> None:
    """Runs in its own process: the CALLERS for `seconds`; puts {kind: {status: count}} on `outcomes`."""
    counts: dict[str, Counter] = {kind: Counter() for kind in CALLERS}
    lock = threading.Lock()
    big = big_messages()
    stop_at = time.monotonic() + seconds

    def record(kind: str, code: str) -> None:
        with lock:
            counts[kind][code] += 1

    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    # Exports nobody reads share a connection whose flow-control window never grows.
    stuck = grpc.insecure_channel(replay_address, options=[("grpc.http2.bdp_probe", 0)])
    loops = {
        "replay: 60 MB AddTrajectories": lambda: unary_loop(
            grpc.insecure_channel(replay_address, options=options), "/rlep.replay.v1.ReplayBuffer/AddTrajectories",
            big["add"], stop_at,
        ),
        "replay: ExportPool never read": lambda: unread_export_loop(stuck, stop_at),
        "replay: ImportPool trickling empty chunks": lambda: trickle_loop(replay_address, stop_at),
        "replay: Sample / ListPools / small adds": lambda: plain_replay_loop(replay_address, stop_at),
        "verifier: 60 MB Verify": lambda: unary_loop(
            grpc.insecure_channel(verifier_address, options=options), "/rlep.verifier.v1.Verifier/Verify",
            big["verify"], stop_at,
        ),
        "verifier: 8-item Verify": lambda: plain_verify_loop(verifier_address, stop_at),
    }  # fmt: skip

    def caller(kind: str) -> None:
        for code in loops[kind]():
            record(kind, code)

    threads = [threading.Thread(target=caller, args=(kind,)) for kind, n in CALLERS.items() for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outcomes.put({kind: dict(counter) for kind, counter in counts.items()})


def big_messages() -> dict[str, bytes]:
    """One ~60 MB AddTrajectories (240 questions' rows of 250 KB) and one Verify (8,000 items of 7.5 KB), serialized
    once: every caller sends the same bytes (the adds after the first are duplicates to replay, nothing evicted)."""
    rows = [success(f"big{i}", i, response_text=f"{i} " + "y" * (BIG_BYTES // 240 - 16)) for i in range(240)]
    item = verifier_pb2.VerifyItem(response="z" * (BIG_BYTES // 8000 - 24) + "\\boxed{1}", ground_truth="1")
    return {
        "add": add_request("mixed-big", rows).SerializeToString(),
        "verify": verifier_pb2.VerifyRequest(items=[item] * 8000).SerializeToString(),
    }


def unary_loop(channel: grpc.Channel, method: str, request: bytes, stop_at: float):
    """Sends `request` (serialized) to `method` again and again, 20 s deadline each; yields each call's status."""
    call = channel.unary_unary(method)  # no serializers: bytes in, bytes out
    while time.monotonic() < stop_at:
        try:
            call(request, timeout=20)
            yield "OK"
        except grpc.RpcError as err:
            yield err.code().name
            time.sleep(0.05)


def unread_export_loop(stuck: grpc.Channel, stop_at: float):
    """Opens an export of the 20 MB pool and never reads it; once it has ended (refused or cancelled), again."""
    stub = replay_pb2_grpc.ReplayBufferStub(stuck)
    while time.monotonic() < stop_at:
        export = stub.ExportPool(replay_pb2.ExportPoolRequest(pool="mixed-export"))
        while not export.done() and time.monotonic() < stop_at:
            time.sleep(0.2)
        if not export.done():
            export.cancel()
            return
        yield export.code().name
        time.sleep(0.5)


def trickle_loop(address: str, stop_at: float):
    """An import sending an empty chunk every 24 s (0.8 x the idle timeout); once it has ended, another."""
    stub = replay_pb2_grpc.ReplayBufferStub(grpc.insecure_channel(address))
    release = threading.Event()
    while time.monotonic() < stop_at:
        future = stub.ImportPool.future(Trickle("mixed-trickle", 24.0, release))
        while not future.done() and time.monotonic() < stop_at:
            time.sleep(0.2)
        if not future.done():
            release.set()  # ends the stream as a finished import
            future.cancel()
            return
        yield "OK" if future.exception() is None else future.exception().code().name
        time.sleep(0.5)


def plain_replay_loop(address: str, stop_at: float):
    stub = replay_pb2_grpc.ReplayBufferStub(grpc.insecure_channel(address))
    sample = replay_pb2.SampleRequest(pool="mixed", question_ids=[f"q{q}" for q in range(16)], m=2)
    n = 0
    while time.monotonic() < stop_at:
        small_add = add_request("mixed", [success(f"h{n}", n)])
        call = (
            lambda: stub.Sample(sample, timeout=10),
            lambda: stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=10),
            lambda: stub.AddTrajectories(small_add, timeout=10),  # noqa: B023 (called before the next turn)
        )[n % 3]
        n += 1
        try:
            call()
            yield "OK"
        except grpc.RpcError as err:
            yield err.code().name


def plain_verify_loop(address: str, stop_at: float):
    stub = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(address))
    n = random.randrange(10**9) * 8  # items of its own: the verdict cache answers none of them
    while time.monotonic() < stop_at:
        items = [verifier_pb2.VerifyItem(response=f"\\boxed{{{n + k}}}", ground_truth=str(n + k)) for k in range(8)]
        n += 8
        try:
            stub.Verify(verifier_pb2.VerifyRequest(items=items), timeout=10)
            yield "OK"
        except grpc.RpcError as err:
            yield err.code().name
