"""Eval's REST port under hostile callers: a 100 KB header, idle and half-sent connections, 1,100 idle connections
(issue 31 item 4), non-strict JSON (5), odd HTTP methods (issue 46 item 10), and 16 readers of sample pages whose
prompts blow up as JSON (issue 46 item 7)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx

from hostile.common import Service, checked
from rlep.common.v1 import trajectory_pb2
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.eval.api import DatasetRequest, EvaluationRequest, JobStatus
from rlep.services.eval.client import EvalClient


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


class FixedRollout(rollout_pb2_grpc.RolloutServicer):
    """A rollout deployment that answers every prompt with n short responses (no vLLM): what eval stores and pages
    is the questions' prompts, not the responses."""

    def Generate(self, request, context):
        sample = rollout_pb2.Sample(
            token_ids=[1] * 5,
            text="\\boxed{2}",
            logprobs=[-0.5] * 5,
            finish_reason=trajectory_pb2.STOP,
            policy_version=1,
        )
        completion = rollout_pb2.Completion(prompt_token_ids=[1, 2, 3], samples=[sample] * request.sampling.n)
        return rollout_pb2.GenerateResponse(completions=[completion] * len(request.prompts), policy_version=1)


# A job of 25 questions x n=8 whose prompts are 16 KiB of control characters: 98 KB each as JSON, 20 MB for the job.
QUESTIONS, N, HUGE = 25, 8, "\x01" * (16 * 1024 - 8)
PAGE_BYTES = 4 << 20  # eval's default max_sample_page_bytes
# Eval builds at most 4 pages at once (CONCURRENT_SAMPLE_PAGES), each holding its <= 4 MiB of JSON several times
# over (Redis rows, parsed samples, the model, its JSON, the response buffer): 16 pages' worth is the budget.
EVAL_RSS_GROWTH_BOUND_MB = 4 * 16 * PAGE_BYTES / 1e6
# 16 readers of 3 pages of limit=1000 each, in a process of their own (as real clients are: not sharing the
# prober's GIL); prints the largest page's size.
READERS = """
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

url = sys.argv[1]

def read_pages(reader):
    largest = 0
    with httpx.Client(timeout=120) as http:
        for _ in range(3):
            with http.stream("GET", url, params={"limit": 1000, "offset": reader}) as response:
                assert response.status_code == 200, response.status_code
                largest = max(largest, sum(len(chunk) for chunk in response.iter_bytes()))
    return largest

with ThreadPoolExecutor(16) as pool:
    print(max(pool.map(read_pages, range(16))))
"""


def big_pages(work: Path) -> dict:
    """Issue 46 item 7: 16 concurrent readers of a job's sample pages whose prompts blow up as JSON; the largest
    page, eval's resident memory and `/healthz` meanwhile."""
    rollout = grpc.server(ThreadPoolExecutor(max_workers=4))
    rollout_pb2_grpc.add_RolloutServicer_to_server(FixedRollout(), rollout)
    rollout_port = rollout.add_insecure_port("127.0.0.1:0")
    rollout.start()
    verifier = Service("verifier")
    dataset = work / "huge-prompts.jsonl"
    rows = [{"problem": f"{HUGE}#{q:05d}", "answer": 2} for q in range(QUESTIONS)]  # prompts differ in their tails
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    evals = Service(
        "eval",
        f'rollout.addresses=["127.0.0.1:{rollout_port}"]',
        f"verifier.address={verifier.address}",
        f'allowed_roots=["{work}"]',
        data_dir=work / "pages-redis",
        http=True,
    )
    try:
        with EvalClient(evals.url) as client:
            request = EvaluationRequest(
                model="current", datasets=[DatasetRequest(name=str(dataset))], n=N, temperature=0.8, max_tokens=32
            )
            job = client.wait(client.submit(request).id, timeout_s=300, poll_s=0.1)
        assert job.status == JobStatus.SUCCEEDED, job.error
        url = f"{evals.url}/v1/evaluations/{job.id}/samples"
        figures = read_beside_probes(evals, url)
    finally:
        evals.stop()
        verifier.stop()
        rollout.stop(0)
    bounds = {
        "page_bytes_max": PAGE_BYTES,
        "health_max_s": 1.0,
        "health_probes_not_200": 0,
        "rss_growth_mb": EVAL_RSS_GROWTH_BOUND_MB,
    }
    return {"46.7 16 readers x 3 pages of limit=1000, prompts 98 KB as JSON": checked(figures, bounds)}


def read_beside_probes(evals: Service, url: str) -> dict:
    """Runs READERS against `url` while probing `/healthz` and sampling eval's resident memory."""
    rss_before, _ = evals.rss_mb()
    readers = subprocess.Popen([sys.executable, "-c", READERS, url], stdout=subprocess.PIPE, text=True)
    probes, not_ok, rss_peak = [], 0, rss_before
    try:
        with httpx.Client(timeout=10) as http:
            while readers.poll() is None:
                started = time.perf_counter()
                not_ok += http.get(f"{evals.url}/healthz").status_code != 200
                probes.append(time.perf_counter() - started)
                rss_peak = max(rss_peak, evals.rss_mb()[0])
                time.sleep(0.05)
        output, _ = readers.communicate(timeout=60)
    finally:
        readers.kill()
    probes.sort()
    return {
        "readers_exit": readers.returncode,
        "page_bytes_max": int(output) if readers.returncode == 0 else None,
        "health_probes": len(probes),
        "health_probes_not_200": not_ok,
        "health_median_s": round(probes[len(probes) // 2], 3),
        "health_max_s": round(probes[-1], 3),
        "rss_before_mb": round(rss_before, 1),
        "rss_growth_mb": round(rss_peak - rss_before, 1),
    }
