"""Issue 31's hostile-client campaign, re-run: what each item that broke does now, against `rlep serve` processes.

Every service starts as an operator starts it (`rlep serve <svc>` on loopback, default settings, no auth), and is
attacked as the issue's campaign did. Per item it records what a caller now gets (status codes, latencies of the
other callers, recovery times, exit codes); the JSON goes to `benchmarks/results/hostile_clients.json`, the table to
the terminal (docs/limits.md quotes it). Rollout (items 1 and 8) starts vLLM: only with `--with-rollout`.

    python benchmarks/hostile_clients.py [--with-rollout] [--load-seconds 30]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.table import Table

from rlep.common.grpc_channel import make_channel
from rlep.common.ports import free_port
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc

RESULTS = Path("benchmarks/results/hostile_clients.json")
RLEP = str(Path(sys.executable).with_name("rlep"))


class Service:
    """One `rlep serve` process; `output` is everything it printed (read after `stop`)."""

    def __init__(self, name: str, *sets: str, data_dir: Path | None = None, http: bool = False):
        self.port = free_port()
        args = [RLEP, "serve", name, "--port", str(self.port)]
        for value in [*sets, *([f"local_redis_dir={data_dir}"] if data_dir else [])]:
            args += ["--set", value]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.address, self.url, self.output = f"127.0.0.1:{self.port}", f"http://127.0.0.1:{self.port}", ""
        deadline = time.monotonic() + 300
        while not (self._http_up() if http else self._grpc_up()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rlep serve {name} did not start: {self.proc.stdout.read()[-2000:]}")
            time.sleep(0.2)

    def _grpc_up(self) -> bool:
        try:
            return health_check_s(self.address, timeout=1) is not None
        except grpc.RpcError:
            return False

    def _http_up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def redis_child(self) -> psutil.Process:
        [child] = [p for p in psutil.Process(self.proc.pid).children() if "redis-server" in p.name()]
        return child

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        self.output, _ = self.proc.communicate(timeout=60)
        return self.proc.returncode


def health_check_s(address: str, timeout: float = 5) -> float | None:
    """Seconds one gRPC health check took, or None when it did not answer SERVING."""
    started = time.perf_counter()
    reply = health_pb2_grpc.HealthStub(make_channel(address)).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return time.perf_counter() - started if reply.status == health_pb2.HealthCheckResponse.SERVING else None


def timed_max(call, times: int = 5) -> float:
    """The slowest of `times` calls, in seconds (a call that fails raises)."""
    worst = 0.0
    for _ in range(times):
        started = time.perf_counter()
        call()
        worst = max(worst, time.perf_counter() - started)
    return round(worst, 3)


class Silent:
    """A request stream opened and left idle, with no deadline, until released."""

    def __init__(self, release: threading.Event):
        self.release = release

    def __iter__(self):
        return self

    def __next__(self):
        self.release.wait()
        raise StopIteration


def idle_streams(address: str, method, other_call, count: int) -> dict:
    """Item 1: `count` idle client streams on `method`; how the others fare while they are open, and their end."""
    release = threading.Event()
    streams = [method(make_channel(address)).future(Silent(release)) for _ in range(count)]
    opened = time.monotonic()
    time.sleep(1.0)  # let the admitted ones reach their handlers (a measurement pause, not a synchronisation)
    refused = Counter(s.exception().code().name for s in streams if s.done())
    figures = {
        "streams": count,
        "refused_at_once": dict(refused),
        "health_max_s": timed_max(lambda: health_check_s(address)),
        "other_call_max_s": timed_max(other_call),
    }
    ended = Counter(s.exception(timeout=120).code().name for s in streams)
    figures["all_ended_after_s"] = round(time.monotonic() - opened, 1)
    figures["ended_with"] = dict(ended)
    release.set()
    return figures


def unread_exports(address: str, stub, count: int) -> dict:
    """Issue 46 item 1: `count` ExportPool calls of a 20 MB pool that never read (one connection whose flow-control
    window never grows); how the others fare, and when an honest export gets a slot again."""
    pool = "hostile-export"
    for q in range(40):
        rows = [success(f"q{q}", i, response_text=f"{i} " + "x" * 65536) for i in range(8)]
        stub.AddTrajectories(add_request(pool, rows), timeout=30)
    stuck = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    request = replay_pb2.ExportPoolRequest(pool=pool)
    exports = [replay_pb2_grpc.ReplayBufferStub(stuck).ExportPool(request) for _ in range(count)]  # never read
    opened = time.monotonic()
    time.sleep(1.0)  # let the admitted ones reach their handlers (a measurement pause, not a synchronisation)
    list_pools = lambda: stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=5)  # noqa: E731
    figures = {
        "exports": count,
        "refused_at_once": dict(Counter(e.code().name for e in exports if e.done())),
        "health_max_s": timed_max(lambda: health_check_s(address)),
        "list_pools_max_s": timed_max(list_pools),
    }
    honest = lambda: sum(1 for _ in stub.ExportPool(request, timeout=60))  # noqa: E731
    while code_of(honest) == "RESOURCE_EXHAUSTED" and time.monotonic() - opened < 120:
        time.sleep(0.2)
    figures["honest_export_admitted_after_s"] = round(time.monotonic() - opened, 1)
    for export in exports:
        export.cancel()
    stuck.close()
    stub.DropPool(replay_pb2.DropPoolRequest(pool=pool, confirm=pool), timeout=60)
    return figures


class Trickle:
    """An ImportPool stream naming its pool, then sending an empty chunk every `every_s` until released."""

    def __init__(self, pool: str, every_s: float, release: threading.Event):
        self.pool, self.every_s, self.release, self.sent = pool, every_s, release, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.sent += 1
        if self.sent > 1 and self.release.wait(self.every_s):
            raise StopIteration
        return replay_pb2.PoolChunk(pool=self.pool if self.sent == 1 else "")


def trickling_imports(address: str, stub, idle_timeout_s: float = 30.0) -> dict:
    """Issue 46 item 2: 4 ImportPool streams sending an empty chunk every 0.8 x the idle timeout; when they end,
    and how 14 honest imports fare once they have."""
    release = threading.Event()
    streams = [stub.ImportPool.future(Trickle("hostile-trickle", 0.8 * idle_timeout_s, release)) for _ in range(4)]
    opened = time.monotonic()
    ended = Counter(code_of(lambda s=s: s.result(timeout=10 * idle_timeout_s)) for s in streams)
    figures = {"streams": 4, "ended_with": dict(ended), "all_ended_after_s": round(time.monotonic() - opened, 1)}
    release.set()
    chunks = [add_request("hostile-trickle", [success(f"q{i}", i)]) for i in range(14)]
    honest = [replay_pb2.PoolChunk(pool=c.pool, trajectories=c.trajectories) for c in chunks]
    figures["honest_imports_after"] = dict(
        Counter(code_of(lambda c=c: stub.ImportPool(iter([c]), timeout=10)) for c in honest)
    )
    stub.DropPool(replay_pb2.DropPoolRequest(pool="hostile-trickle", confirm="hostile-trickle"), timeout=60)
    return figures


def replay_items(work: Path) -> dict:
    out: dict = {}
    replay = Service("replay", data_dir=work / "replay-redis")
    channel = make_channel(replay.address)
    stub = replay_pb2_grpc.ReplayBufferStub(channel)
    list_pools = lambda: stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=5)  # noqa: E731
    try:
        out["1 idle ImportPool streams"] = [
            idle_streams(replay.address, lambda c: replay_pb2_grpc.ReplayBufferStub(c).ImportPool, list_pools, n)
            for n in (16, 64)
        ]
        out["46.1 16 ExportPool calls that never read"] = unread_exports(replay.address, stub, 16)
        out["46.2 4 ImportPool streams trickling empty chunks"] = trickling_imports(replay.address, stub)
        out["3 embedded Redis kill -9"] = redis_kill(stub, replay)
        out["7 add to pool 'base\\n'"] = code_of(
            lambda: stub.AddTrajectories(add_request("base\n", [success("q", 0)]), timeout=5)
        )
        nan = stub.AddTrajectories(nan_add(), timeout=5)
        out["9 NaN behavior_logprobs"] = {"added": nan.added, "rejected": [r.reason for r in nan.rejections]}
        out["9 one add of 20,000 rows"] = big_add(stub, list_pools)
        out["10 wrong pool files"] = wrong_pool_files(replay, stub, work)
    finally:
        channel.close()
        replay.stop()
    password = (work / "replay-redis" / "redis.password").read_text().strip()
    out["6 password in replay's output"] = password in replay.output
    return out


def success(qid: str, i: int, **fields) -> dict:
    return {"question_id": qid, "response_text": f"answer {i} \\boxed{{{i}}}", "reward": 1.0, "verdict": 1, **fields}


def add_request(pool: str, rows: list[dict]) -> replay_pb2.AddTrajectoriesRequest:
    from rlep.common.v1 import trajectory_pb2

    return replay_pb2.AddTrajectoriesRequest(pool=pool, trajectories=[trajectory_pb2.Trajectory(**r) for r in rows])


def nan_add() -> replay_pb2.AddTrajectoriesRequest:
    return add_request("p", [success("q", 0, response_token_ids=[1, 2], behavior_logprobs=[-0.1, math.nan])])


def code_of(call) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as err:
        return err.code().name


def redis_kill(stub, replay: Service) -> dict:
    """Item 3: adds acknowledged, redis-server killed, adds retried until they land again."""
    assert stub.AddTrajectories(add_request("p", [success(f"k{i}", i) for i in range(100)]), timeout=5).added == 100
    old = replay.redis_child()
    old.kill()
    killed, refused = time.monotonic(), Counter()
    while True:
        try:
            stub.AddTrajectories(add_request("p", [success("k100", 100)]), timeout=5)
            break
        except grpc.RpcError as err:
            refused[err.code().name] += 1
            if time.monotonic() - killed > 60:
                return {"recovered": False, "refused": dict(refused)}
            time.sleep(0.02)
    landed_s = time.monotonic() - killed
    stats = stub.GetPoolStats(replay_pb2.GetPoolStatsRequest(pool="p"), timeout=5)
    return {
        "adds_land_again_after_s": round(landed_s, 2),
        "refused_meanwhile": dict(refused),
        "acknowledged_before_kill_kept": stats.trajectories == 101,
        "health_after": "SERVING" if health_check_s(replay.address) else "NOT_SERVING",
        "new_redis_pid": replay.redis_child().pid != old.pid,
    }


def big_add(stub, list_pools) -> dict:
    """Item 9: one AddTrajectories of 20,000 rows for one question; another caller's slowest ListPools meanwhile."""
    request = add_request("big", [success("one", i) for i in range(20_000)])
    done, worst = threading.Event(), [0.0]

    def other_caller() -> None:
        while not done.is_set():
            started = time.perf_counter()
            list_pools()
            worst[0] = max(worst[0], time.perf_counter() - started)

    thread = threading.Thread(target=other_caller)
    thread.start()
    started = time.perf_counter()
    reply = stub.AddTrajectories(request, timeout=120)
    took = time.perf_counter() - started
    done.set()
    thread.join()
    return {"add_s": round(took, 2), "added": reply.added, "other_caller_max_s": round(worst[0], 3)}


def wrong_pool_files(replay: Service, stub, work: Path) -> dict:
    """Item 10: RLEP-format files in the wrong schema: exit code of `rlep pool import`, and whether a pool appeared."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompt = [[{"role": "user", "content": f"What is {i}+1?"}] for i in range(40)]
    model = [{"ground_truth": str(i + 1), "candidates": [f"\\boxed{{{i + 1}}}"] * 2} for i in range(40)]
    files = {
        "prompt column named problem": pa.table({"problem": prompt, "reward_model": model}),
        "candidates as a top-level column": pa.table(
            {"prompt": prompt, "candidates": [m["candidates"] for m in model], "answer": [str(i) for i in range(40)]}
        ),
        "a plain training parquet": pa.table({"prompt": prompt, "reward_model": [{"ground_truth": "1"}] * 40}),
    }
    out = {}
    for name, table in files.items():
        path = work / (name.replace(" ", "-") + ".parquet")
        pq.write_table(table, path)
        pool = "wrong-" + str(len(out))
        run = subprocess.run(
            [RLEP, "pool", "import", str(path), "--pool", pool, "--address", replay.address],
            capture_output=True,
            text=True,
        )
        pools = stub.ListPools(replay_pb2.ListPoolsRequest(), timeout=5).pools
        out[name] = {"exit": run.returncode, "pool_created": pool in pools, "says": run.stderr.strip()[-160:]}
    return out


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


def eval_items(work: Path) -> dict:
    evals = Service("eval", data_dir=work / "eval-redis", http=True)
    out: dict = {}
    try:
        big_header = httpx.get(f"{evals.url}/healthz", headers={"X-Big": "a" * 100_000})
        out["4 100 KB header"] = big_header.status_code
        out["4 idle connection closed after s"] = closed_after(evals.port, b"")
        out["4 Content-Length beyond the body, closed after s"] = closed_after(
            evals.port, b"POST /v1/evaluations HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{}"
        )
        out["4 /healthz beside 1,100 idle connections"] = many_idle(evals, 1100)
        out["5 non-strict JSON"] = {
            body: httpx.post(
                f"{evals.url}/v1/evaluations", content=body, headers={"Content-Type": "application/json"}
            ).status_code
            for body in ('{"n": NaN}', '{"n": Infinity}', '{"n": 1e400}', '{"model": "\\ud800"}')
        }
        with httpx.Client(timeout=10) as http:  # issue 46 item 10: a 1 KB method of its own per request
            for number in range(3000):
                http.request(f"M{number:04d}" + "X" * 1020, f"{evals.url}/v1/evaluations")
            metrics = http.get(f"{evals.url}/metrics").text
        out["46.10 request-latency series after 3,000 odd methods"] = {
            "series": sum(line.startswith("rlep_eval_request_seconds_count") for line in metrics.splitlines()),
            "/metrics bytes": len(metrics),
        }
    finally:
        evals.stop()
    out["6 password in eval's output"] = (work / "eval-redis" / "redis.password").read_text().strip() in evals.output
    return out


def closed_after(port: int, send: bytes, limit_s: float = 60) -> float | None:
    """Seconds until the server closes a connection that sent `send` and then nothing (None: still open)."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(send)
        conn.settimeout(limit_s)
        started = time.monotonic()
        try:
            while conn.recv(4096):
                pass
        except (TimeoutError, ConnectionResetError):
            pass
        took = time.monotonic() - started
    return round(took, 1) if took < limit_s else None


def many_idle(evals: Service, count: int) -> dict:
    conns = []
    try:
        for _ in range(count):
            conns.append(socket.create_connection(("127.0.0.1", evals.port)))
        started = time.perf_counter()
        status = httpx.get(f"{evals.url}/healthz", timeout=10).status_code
        took = time.perf_counter() - started
    except (OSError, httpx.HTTPError) as err:
        return {"opened": len(conns), "error": str(err)}
    finally:
        for conn in conns:
            conn.close()
    return {"opened": len(conns), "status": status, "seconds": round(took, 3)}


def cli_items(work: Path) -> dict:
    """Item 9: an empty token file."""
    empty = work / "empty-token"
    empty.write_text("")
    run = subprocess.run(
        [RLEP, "serve", "verifier", "--port", "0", "--auth-token-file", str(empty)], capture_output=True, text=True
    )
    return {"9 empty --auth-token-file": {"exit": run.returncode, "stderr_lines": len(run.stderr.strip().splitlines())}}


def rollout_items(work: Path) -> dict:
    sets = ["engine.model=tiny", "engine.enforce_eager=true", "engine.max_model_len=256"]
    rollout = Service("rollout", *sets)
    stub = rollout_pb2_grpc.RolloutStub(make_channel(rollout.address))
    generate = lambda: stub.Generate(  # noqa: E731
        rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(text="Q: 1+1=?\nA: ")], sampling=rollout_pb2.SamplingOptions(n=1, max_tokens=4)
        ),
        timeout=10,
    )
    try:
        generate()  # the first one pays vLLM's warm-up, which is not what is measured
        out = {
            "1 idle UpdateWeights streams": [
                idle_streams(rollout.address, lambda c: rollout_pb2_grpc.RolloutStub(c).UpdateWeights, generate, n)
                for n in (16, 64)
            ]
        }
        probes = {}
        for path in ("/etc/passwd", "/nonexistent/file", str(Path(tempfile.gettempdir()) / "rlep-push-x.safetensors")):
            header = rollout_pb2.WeightChunk(
                header=rollout_pb2.WeightHeader(version=99, total_bytes=17, sha256="0" * 64)
            )
            try:
                stub.UpdateWeights(iter([header, rollout_pb2.WeightChunk(shared_file=path)]), timeout=10)
                probes[path] = "OK"
            except grpc.RpcError as err:
                probes[path] = f"{err.code().name}: {err.details()}"
        out["8 shared_file answers identical for every path"] = len(set(probes.values())) == 1
        out["8 shared_file answer"] = next(iter(probes.values()))
    finally:
        rollout.stop()
    return out


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


PARTS = {
    "replay": lambda work, args: replay_items(work),
    "verifier": lambda work, args: verifier_items(),
    "scorer": lambda work, args: scorer_items(),
    "eval": lambda work, args: eval_items(work),
    "cli": lambda work, args: cli_items(work),
    "rollout": lambda work, args: rollout_items(work),
    "load": lambda work, args: {"load": load(args.load_seconds, work)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--with-rollout", action="store_true", help="also rollout's items 1 and 8 (starts vLLM)")
    parser.add_argument("--load-seconds", type=float, default=30.0, help="per load run (0 skips the load runs)")
    parser.add_argument("--only", action="append", choices=sorted(PARTS), help="re-run these parts, keep the rest")
    args = parser.parse_args()
    parts = args.only or [
        p for p in PARTS if (p != "rollout" or args.with_rollout) and (p != "load" or args.load_seconds)
    ]
    work = Path(tempfile.mkdtemp(prefix="rlep-hostile-"))
    results: dict = json.loads(RESULTS.read_text()) if args.only and RESULTS.exists() else {}
    try:
        for part in parts:
            started = os.getloadavg()
            results.update(PARTS[part](work, args))
            results.setdefault("load average (1 min) at start, end", {})[part] = [started[0], os.getloadavg()[0]]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    table = Table(title="hostile clients (issue 31), measured now")
    table.add_column("item")
    table.add_column("what a caller gets now")
    for item, figures in results.items():
        table.add_row(item, json.dumps(figures))
    Console(width=200).print(table)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
