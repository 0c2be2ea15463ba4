"""Replay under hostile callers: idle, unread and trickling streams (issue 31 item 1, issue 46 items 1-2), its
embedded Redis killed (item 3), a pool name with a newline (7), NaN log-probabilities and one add of 20,000 rows (9),
pool files of the wrong schema (10); issue 48's per-question history: a report of 10^6 questions, NaN rewards, a step
reported twice, an unknown pool; issue 50's tool traces: masks that do not fit, the largest trace, a pool file of bad
traces."""

from __future__ import annotations

import math
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from hostile.common import RLEP, Service, code_of, health_check_s, idle_streams, timed_max
from rlep.common.grpc_channel import make_channel
from rlep.common.v1 import trajectory_pb2
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc


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
        out["48 hostile ReportOutcomes"] = hostile_reports(stub)
        out["50 hostile tool traces"] = hostile_traces(replay, stub, list_pools, work)
    finally:
        channel.close()
        replay.stop()
    password = (work / "replay-redis" / "redis.password").read_text().strip()
    out["6 password in replay's output"] = password in replay.output
    return out


def success(qid: str, i: int, **fields) -> dict:
    return {"question_id": qid, "response_text": f"answer {i} \\boxed{{{i}}}", "reward": 1.0, "verdict": 1, **fields}


def add_request(pool: str, rows: list[dict]) -> replay_pb2.AddTrajectoriesRequest:
    return replay_pb2.AddTrajectoriesRequest(pool=pool, trajectories=[trajectory_pb2.Trajectory(**r) for r in rows])


def nan_add() -> replay_pb2.AddTrajectoriesRequest:
    return add_request("p", [success("q", 0, response_token_ids=[1, 2], behavior_logprobs=[-0.1, math.nan])])


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


def hostile_traces(replay: Service, stub, list_pools, work: Path) -> dict:
    """Issue 50, part 3: traces whose mask does not fit, with a NaN logprob on a policy token, 65 calls; the largest
    trace the pool takes (64 calls of 15 KiB output each) stored and sampled back while another caller lists pools;
    a pool file whose `rlep_traces` hold garbage, another question's trace, an unmasked one and a 2 MB blob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlep.common.pool_parquet import POOL_SCHEMA

    call = {"code": "print(1)", "status": "ok", "exit_code": 0, "stdout": "1\n"}
    trace = {"response_token_ids": [1, 2, 3], "response_mask": [1, 0, 1], "behavior_logprobs": [-0.1, math.nan, -0.2]}
    bad = [
        success("q", 1, **{**trace, "response_mask": [1, 0]}),
        success("q", 2, **{**trace, "behavior_logprobs": [math.nan, math.nan, -0.2]}),
        success("q", 3, **trace, tool_calls=[call] * 65),
    ]
    reply = stub.AddTrajectories(add_request("traces", bad), timeout=5)
    out: dict = {"bad traces": {"added": reply.added, "rejected": [r.reason for r in reply.rejections]}}
    biggest = success("big", 0, **trace, tool_calls=[{**call, "stdout": "x" * (15 << 10)}] * 64)
    started = time.perf_counter()
    added = stub.AddTrajectories(add_request("traces", [biggest]), timeout=30).added
    drawn = stub.Sample(replay_pb2.SampleRequest(pool="traces", question_ids=["big"], m=1), timeout=30)
    list_started = time.perf_counter()
    list_pools()
    out["64 calls x 15 KiB"] = {
        "bytes": trajectory_pb2.Trajectory(**biggest).ByteSize(),
        "added": added,
        "calls_back": len(drawn.samples[0].trajectories[0].tool_calls) if drawn.samples else 0,
        "seconds": round(time.perf_counter() - started, 3),
        "list_pools_s": round(time.perf_counter() - list_started, 3),
    }
    good = trajectory_pb2.Trajectory(**success("q", 0, **trace)).SerializeToString()
    other = trajectory_pb2.Trajectory(**success("another", 0, **trace)).SerializeToString()
    unmasked = trajectory_pb2.Trajectory(**success("q", 4)).SerializeToString()
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "reward_model": {"ground_truth": "0", "candidates": []},
        "extra_info": {"index": 0, "question_id": "q"},
        "rlep_traces": [good, b"\xff garbage", other, unmasked, b"x" * (2 << 20)],
    }
    path = work / "hostile-traces.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=POOL_SCHEMA), path)
    run = subprocess.run(
        [RLEP, "pool", "import", str(path), "--pool", "traces-file", "--address", replay.address],
        capture_output=True,
        text=True,
    )
    stored = stub.GetPoolStats(replay_pb2.GetPoolStatsRequest(pool="traces-file"), timeout=5).trajectories
    says = (run.stdout + run.stderr).strip()[-200:]
    out["pool file with bad traces"] = {"exit": run.returncode, "stored": stored, "says": says}
    return out


def hostile_reports(stub) -> dict:
    """Issue 48: ReportOutcomes of 10^6 questions (code and seconds), a NaN reward, a step reported twice, an unknown
    pool; and whether the pool's history changed."""
    stub.AddTrajectories(add_request("history", []), timeout=5)

    def report(step: int, outcomes, pool: str = "history"):
        return replay_pb2.ReportOutcomesRequest(pool=pool, run_id="run", step=step, outcomes=outcomes)

    one = [replay_pb2.QuestionOutcome(question_id="q", attempts=4, successes=1)]
    stub.ReportOutcomes(report(1, one), timeout=5)
    before = stub.GetPoolStats(replay_pb2.GetPoolStatsRequest(pool="history"), timeout=5)
    huge = report(2, [replay_pb2.QuestionOutcome(question_id=f"q{i}", attempts=4) for i in range(10**6)])
    started = time.perf_counter()
    out = {"10^6 questions": code_of(lambda: stub.ReportOutcomes(huge, timeout=60))}
    out["10^6 questions refused after s"] = round(time.perf_counter() - started, 2)
    nan = [replay_pb2.QuestionOutcome(question_id="q", attempts=4, successes=1, mean_reward=math.nan)]
    out["NaN mean_reward"] = code_of(lambda: stub.ReportOutcomes(report(2, nan), timeout=5))
    out["step 1 again: duplicate"] = stub.ReportOutcomes(report(1, one), timeout=5).duplicate
    out["unknown pool"] = code_of(lambda: stub.ReportOutcomes(report(2, one, "no-such-pool"), timeout=5))
    after = stub.GetPoolStats(replay_pb2.GetPoolStatsRequest(pool="history"), timeout=5)
    out["history unchanged"] = (before.questions_with_history, before.history_reports) == (
        after.questions_with_history,
        after.history_reports,
    )
    stub.DropPool(replay_pb2.DropPoolRequest(pool="history", confirm="history"), timeout=60)
    return out
