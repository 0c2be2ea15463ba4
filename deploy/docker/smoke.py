"""Live smoke test of docker-compose.yml on one Docker host; deploy/docker/smoke.sh builds the images and runs it.

What it does, against containers it starts itself (project `rlepsmoke`, ports on loopback only):
  1. the image: runs as uid 1000, `rlep serve <svc> --dry-run` for every service;
  2. `up` of Redis (AOF), verifier, replay, rollout, eval and Prometheus, all healthy;
  3. the learner job, a few RLEP steps on a tiny arithmetic set whose candidates seed the pool, while
     Prometheus must see every target (learner included) with up == 1;
  4. `rlep pool stats` from the host, then an eval job through the REST API until it succeeds;
  5. `down` and `up` again: the pool is still there and the learner resumes from its checkpoint volume;
  6. mid-run, replay's process is killed with SIGKILL from the host (a crash); Docker's restart policy
     brings it back, and the run must end at its last step with every step logged once and no pool loss.
Prints one `smoke:` line per result and exits non-zero at the first failure; `down -v` always runs.

Not covered: Grafana (no Debian package; its dashboard is checked offline by tests/unit), TLS, GPUs.
`docker kill` is not the fault used: Docker treats it as a manual stop and never restarts the container.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "rlepsmoke"
IMAGE = os.environ.get("RLEP_IMAGE", "rlep:latest")
COMPOSE = ["docker-compose", "-p", PROJECT, "-f", "docker-compose.yml", "-f", "deploy/docker/compose.local.yml"]
STACK = ["redis", "verifier", "replay", "rollout", "eval", "prometheus"]  # Grafana: see the docstring
PORTS = [50061, 50062, 50063, 9461, 9462, 9463, 9464, 8080, 9090]
JOBS = {"rlep-verifier", "rlep-replay", "rlep-rollout", "rlep-eval", "rlep-learner"}
TOKEN_FILE = ROOT / "deploy/docker/secrets/auth-token"
POOL = "smoke"
# The learner serves /metrics only once its steps begin, and Prometheus scrapes every 15 s. 15 steps take 15-45 s
# here, which alone may fall between two scrapes (it did on a quiet host); the compose file's learner keeps
# /metrics up 30 s after its last step (metrics_linger_s), so every run is scraped at least once.
# The resumed run's 45 steps leave it many steps, each sampling replay, after replay is killed.
FIRST_STEPS, TOTAL_STEPS = 15, 60
# rollout's first start builds the tiny model and compiles vLLM's CPU sampler (its start_period is 300 s);
# on a loaded 2-core host that took minutes, so every wait is generous but finite.
HEALTHY_TIMEOUT_S = 900
LEARNER_TIMEOUT_S = 900
EVAL_TIMEOUT_S = 300
# A small RLEP run through the compose file's own learner command: env sits below its --set flags and over
# /etc/rlep/train.yaml (configs/train.yaml), so only sizes and the data change.
LEARNER_ENV = {
    "RLEP_TRAIN__RUN_ID": "smoke",
    "RLEP_TRAIN__REPLAY_POOL": POOL,
    "RLEP_TRAIN__DATA__TRAIN_FILES": '["/data/smoke.parquet"]',
    "RLEP_TRAIN__ALGORITHM__QUESTIONS_PER_STEP": "4",
    "RLEP_TRAIN__ALGORITHM__FRESH_PER_QUESTION": "4",
    "RLEP_TRAIN__ALGORITHM__REPLAYED_PER_QUESTION": "2",
    "RLEP_TRAIN__ALGORITHM__MINI_BATCH_QUESTIONS": "4",
    "RLEP_TRAIN__ALGORITHM__MAX_RESPONSE_TOKENS": "32",
    "RLEP_TRAIN__ALGORITHM__OVERLONG_BUFFER_TOKENS": "8",
    "RLEP_TRAIN__OPTIM__MICRO_BATCH_SIZE": "32",
    "RLEP_TRAIN__OPTIM__WARMUP_STEPS": "1",
    "RLEP_TRAIN__CHECKPOINT__EVERY_STEPS": "1",
}


def say(message: str) -> None:
    print(f"smoke: {message}", flush=True)


def fail(message: str) -> None:
    raise SystemExit(f"smoke: FAILED: {message}")


def run(args: list[str], timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        fail(f"{' '.join(args[:6])}... exited {result.returncode}: {result.stderr[-2000:]}")
    return result


def compose(*args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    return run([*COMPOSE, *args], timeout_s=timeout_s, check=check)


def check_ports_free() -> None:
    for port in PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                fail(f"127.0.0.1:{port} is in use; compose publishes it")


def check_image() -> None:
    uid = run(["docker", "run", "--rm", IMAGE, "id", "-u"]).stdout.strip()
    if uid != "1000":
        fail(f"{IMAGE} runs as uid {uid}, not 1000")
    for service in ("verifier", "replay", "rollout", "eval"):
        out = run(["docker", "run", "--rm", IMAGE, "rlep", "serve", service, "--dry-run"]).stdout
        json.loads(out)  # the resolved config, as JSON
    say(f"{IMAGE}: uid 1000; `rlep serve {{verifier,replay,rollout,eval}} --dry-run` print their configs")


def container(service: str) -> str:
    ids = compose("ps", "-q", service).stdout.split()
    if len(ids) != 1:
        fail(f"{service}: {len(ids)} containers")
    return ids[0]


def inspect(container_id: str, template: str) -> str:
    return run(["docker", "inspect", "-f", template, container_id]).stdout.strip()


def wait_healthy(services: list[str]) -> float:
    """Seconds until every service with a health check reports healthy (and the others run)."""
    start = time.monotonic()
    while True:
        states = {}
        for service in services:
            cid = container(service)
            health = inspect(cid, "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}")
            states[service] = health
        if all(state in ("healthy", "running") for state in states.values()):
            return time.monotonic() - start
        if time.monotonic() - start > HEALTHY_TIMEOUT_S:
            fail(f"not healthy after {HEALTHY_TIMEOUT_S} s: {states}")
        time.sleep(5)


def up() -> None:
    start = time.monotonic()
    compose("up", "-d", "--no-build", *STACK, timeout_s=HEALTHY_TIMEOUT_S)  # waits for depends_on's health
    wait_healthy(STACK)
    waited = time.monotonic() - start
    # The image's health-check script, called as compose calls it, answering by hand.
    compose("exec", "-T", "verifier", "python", "/opt/rlep/healthcheck.py", "grpc", "127.0.0.1:50061")
    compose("exec", "-T", "eval", "python", "/opt/rlep/healthcheck.py", "http", "http://127.0.0.1:8080/healthz")
    say(f"up: {', '.join(STACK)} healthy after {waited:.0f} s; healthcheck.py answers (grpc and http)")


def learner_command() -> list[str]:
    """The compose file's own learner command (from `docker-compose config`), for --resume runs."""
    import yaml

    return yaml.safe_load(compose("config").stdout)["services"]["learner"]["command"]


def start_learner(steps: int, resume: bool, log: Path) -> subprocess.Popen:
    env = [arg for key, value in LEARNER_ENV.items() for arg in ("-e", f"{key}={value}")]
    command = [*learner_command(), "--resume"] if resume else []
    # --use-aliases: the job is reachable as `learner`, the name Prometheus scrapes (compose run omits it).
    args = [*COMPOSE, "run", "--rm", "--use-aliases", *env, "-e", f"RLEP_TRAIN__STEPS={steps}", "learner", *command]
    return subprocess.Popen(args, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def learner_log_steps() -> list[int]:
    """Steps in the learner's JSONL log on its checkpoint volume (read through a throwaway container)."""
    volume = f"{PROJECT}_learner-checkpoints"
    result = run(["docker", "run", "--rm", "-v", f"{volume}:/c:ro", IMAGE, "cat", "/c/log.jsonl"], check=False)
    return [json.loads(line)["step"] for line in result.stdout.splitlines() if line.strip()]


def prometheus_up() -> dict[str, float]:
    with urllib.request.urlopen("http://127.0.0.1:9090/api/v1/query?query=up", timeout=5) as reply:
        data = json.load(reply)["data"]["result"]
    return {r["metric"]["job"]: float(r["value"][1]) for r in data}


def wait_learner(process: subprocess.Popen, log: Path, watch_scrapes: bool) -> dict[str, float]:
    """Waits for the learner job; with watch_scrapes, returns the first `up` reading with every job at 1."""
    start, seen = time.monotonic(), {}
    while process.poll() is None:
        if time.monotonic() - start > LEARNER_TIMEOUT_S:
            process.kill()
            fail(f"learner still running after {LEARNER_TIMEOUT_S} s; tail: {log.read_text()[-2000:]}")
        if watch_scrapes and not seen:
            try:
                reading = prometheus_up()
            except OSError:
                reading = {}
            if set(reading) >= JOBS and all(reading[job] == 1 for job in JOBS):
                seen = reading
        time.sleep(3)
    if process.returncode != 0:
        fail(f"learner exited {process.returncode}; tail: {log.read_text()[-3000:]}")
    return seen


def pool_trajectories() -> int:
    """`rlep pool stats` from the host, through the published replay port; returns the trajectory count."""
    rlep = str(Path(sys.executable).parent / "rlep")
    result = run([rlep, "pool", "stats", POOL, "--address", "127.0.0.1:50062", f"--auth-token-file={TOKEN_FILE}"])
    match = re.search(r"trajectories\s*\S\s*(\d+)", result.stdout)
    if not match:
        fail(f"no trajectory count in `rlep pool stats`: {result.stdout}")
    return int(match.group(1))


def eval_job() -> dict:
    """Submits a small eval of the current policy through eval's REST API and waits for it to finish."""
    token = TOKEN_FILE.read_text().strip()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    body = {
        "model": "current",
        "datasets": [{"name": "gsm8k", "limit": 2}],
        "n": 2,
        "temperature": 1.0,
        "max_tokens": 16,
    }
    request = urllib.request.Request(
        "http://127.0.0.1:8080/v1/evaluations", json.dumps(body).encode(), headers, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        job = json.load(reply)
    start = time.monotonic()
    while job["status"] in ("queued", "running"):
        if time.monotonic() - start > EVAL_TIMEOUT_S:
            fail(f"eval job {job['id']} still {job['status']} after {EVAL_TIMEOUT_S} s")
        time.sleep(3)
        read = urllib.request.Request(f"http://127.0.0.1:8080/v1/evaluations/{job['id']}", headers=headers)
        with urllib.request.urlopen(read, timeout=30) as reply:
            job = json.load(reply)
    if job["status"] != "succeeded":
        fail(f"eval job {job['id']} {job['status']}: {job.get('error')}")
    return job


def write_data(directory: Path) -> None:
    """A tiny RLEP-format training set (the demo's arithmetic task with candidates, which seed the pool)."""
    from rlep.services.demo.task import make_problems, write_parquet

    write_parquet(make_problems(16, 0, "train"), directory / "smoke.parquet", with_candidates=True)
    # The learner runs as uid 1000; mkdtemp makes a 0700 directory.
    directory.chmod(0o755)
    (directory / "smoke.parquet").chmod(0o644)


def crash_replay_mid_run(log: Path) -> None:
    """Runs the learner on to TOTAL_STEPS with --resume and SIGKILLs replay's process once a step is logged."""
    before = learner_log_steps()
    process = start_learner(TOTAL_STEPS, resume=True, log=log)
    start = time.monotonic()
    while len(learner_log_steps()) <= len(before):
        if process.poll() is not None or time.monotonic() - start > LEARNER_TIMEOUT_S:
            fail(f"the resumed learner logged no step; tail: {log.read_text()[-3000:]}")
        time.sleep(0.5)  # steps take about a second: kill early in the run
    replay = container("replay")
    restarts = int(inspect(replay, "{{.RestartCount}}"))
    pid = inspect(replay, "{{.State.Pid}}")
    run(["kill", "-9", pid])
    say(f"fault: SIGKILL to replay (host pid {pid}) after learner step {learner_log_steps()[-1]}")
    try:
        wait_learner(process, log, watch_scrapes=False)
        retries = [line for line in log.read_text().splitlines() if "outage left" in line]
        if not retries:
            fail("the learner never called replay while it was down: the fault tested nothing")
        say(f"fault: the learner carried on through replay's restart ({len(retries)} calls retried while it was down)")
    except SystemExit:
        error = [line for line in log.read_text().splitlines() if line.strip()][-1:]
        say(f"fault: the learner stopped at step {learner_log_steps()[-1]} ({error}); resuming from its checkpoint")
        retry = log.with_suffix(".retry.log")  # the first log keeps the failure
        wait_learner(start_learner(TOTAL_STEPS, resume=True, log=retry), retry, watch_scrapes=False)
    now = int(inspect(replay, "{{.RestartCount}}"))
    if now != restarts + 1:
        fail(f"replay restarted {now - restarts} times, expected 1")
    wait_healthy(["replay"])
    say(f"fault: Docker restarted replay (RestartCount {restarts} -> {now}); healthy again")


def main() -> None:
    check_ports_free()
    run(["deploy/docker/make-secrets.sh"])
    check_image()
    data = Path(tempfile.mkdtemp(prefix="rlep-smoke-data-"))
    write_data(data)
    os.environ["RLEP_DATA_DIR"] = str(data)
    logs = Path(tempfile.mkdtemp(prefix="rlep-smoke-logs-"))
    compose("down", "-v", "--remove-orphans")  # a previous run's leftovers
    try:
        up()
        log = logs / "learner-1.log"
        seen = wait_learner(start_learner(FIRST_STEPS, resume=False, log=log), log, watch_scrapes=True)
        steps = learner_log_steps()
        if steps != list(range(1, FIRST_STEPS + 1)):
            fail(f"learner log steps {steps}, expected 1..{FIRST_STEPS}")
        say(f"learner: {FIRST_STEPS} RLEP steps; last line: {log.read_text().strip().splitlines()[-1]}")
        if not seen:
            fail(f"Prometheus never had every target up during the learner run: {prometheus_up()}")
        say(f"prometheus: up == 1 for {', '.join(sorted(seen))}")
        trajectories = pool_trajectories()
        if trajectories == 0:
            fail(f"pool {POOL} is empty after the learner seeded it")
        say(f"rlep pool stats (host): pool {POOL} holds {trajectories} trajectories")
        job = eval_job()
        say(f"eval job {job['id']} succeeded: {json.dumps(job['results'])[:400]}")

        compose("down")
        say("down (volumes kept)")
        up()
        after = pool_trajectories()
        if after != trajectories:
            fail(f"pool had {trajectories} trajectories before down/up, {after} after")
        say(f"after down/up: pool {POOL} still holds {after} trajectories")

        crash_replay_mid_run(logs / "learner-2.log")
        steps = learner_log_steps()
        if sorted(set(steps)) != list(range(1, TOTAL_STEPS + 1)):
            fail(f"learner log steps {steps}, expected 1..{TOTAL_STEPS}")
        say(f"learner resumed from step {FIRST_STEPS} and ended at step {TOTAL_STEPS}; log steps {steps}")
        final = pool_trajectories()
        if final < after:
            fail(f"pool lost trajectories across the crash: {after} -> {final}")
        say(f"pool {POOL}: {final} trajectories after the crash (was {after})")
        say(f"PASSED (logs in {logs})")
    finally:
        # The containers' own logs outlive them here, for a failure's post-mortem.
        (logs / "stack.log").write_text(compose("logs", "--no-color", "--timestamps", check=False).stdout)
        if ids := compose("ps", "-q", check=False).stdout.split():  # health-check history included
            (logs / "inspect.json").write_text(run(["docker", "inspect", *ids], check=False).stdout)
        compose("down", "-v", "--remove-orphans", check=False)


if __name__ == "__main__":
    main()
