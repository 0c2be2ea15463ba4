"""`rlep doctor`: the preflight a user runs on their own node before a long job.

Owns the checks and their order, running the heavy ones in processes of their own
(services/cli/doctor_workers.py), and the report: a rich table, `--json`, and the exit status (1 naming
the first failed check, never a traceback). The supported versions are in services/cli/doctor_versions.py.

Checks, each with a GPU variant (CUDA visible) and a CPU variant (what CI runs):
1. `versions`: torch, CUDA, NCCL, DeepSpeed, vLLM, Ray, transformers against `SUPPORTED`.
2. `learner`: one update of the real `DeepSpeedPolicy` on a tiny model, one process per visible GPU (else one
   on the CPU): finite statistics, every weight tensor moved.
3. `rollout`: a vLLM replica as a run starts it; generate, push perturbed weights, and its logprobs against
   the learner's reference before and after the push.
4. `broadcast`: the weight broadcast between two processes: NCCL between two GPUs, else gloo (CPU variant).
docs/doctor.md says what a failure means and what to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

import typer

from rlep.services.cli.doctor_versions import SUPPORTED, installed_versions, version_problems

# Each worker's time limit. The learner's first run on a node compiles DeepSpeed's shm comm op (~3 min on 2
# CPU cores); a replica starts in 35-90 s on CPU plus a one-time compile of the sampler (~50 s cold), longer
# for a large --model; a broadcast of a tiny model takes seconds once both processes are up (~20 s of imports).
LEARNER_TIMEOUT_S = 900.0
ROLLOUT_TIMEOUT_S = 900.0
BROADCAST_TIMEOUT_S = 300.0
BROADCAST_GROUP_TIMEOUT_S = 60.0  # the group's own bound on joining and on each tensor
LOG_TAIL_LINES = 12
WORKER_POLL_S = 0.2

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Outcome:
    status: Status
    detail: str
    values: dict = field(default_factory=dict)
    log_tail: list[str] = field(default_factory=list)
    """Last lines a failed worker logged before its traceback (if it raised)."""
    log_file: str | None = None
    """A failed worker's whole stderr, kept."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    seconds: float
    detail: str
    values: dict = field(default_factory=dict)
    log_tail: list[str] = field(default_factory=list)
    log_file: str | None = None


@dataclass(frozen=True)
class Node:
    """What the checks run on: the CUDA_VISIBLE_DEVICES entries of the visible GPUs (none: the CPU variants)."""

    gpus: tuple[str, ...]
    model: Path

    @property
    def label(self) -> str:
        return f"{len(self.gpus)} GPU(s)" if self.gpus else "CPU"


# -- checks ------------------------------------------------------------------------------------
def check_versions(node: Node) -> Outcome:
    installed, provided_by = installed_versions()
    problems = version_problems(installed)
    if problems:
        return Outcome("fail", "; ".join(problems), installed)
    shown = {**installed, "cuda": installed.get("cuda", "cpu")}
    names = [name for name in SUPPORTED if name in shown]
    return Outcome("pass", ", ".join(f"{provided_by.get(n, n)} {shown[n]}" for n in names), installed)


# -- workers (processes of their own) ----------------------------------------------------------
@dataclass(frozen=True)
class Worker:
    job: str
    kwargs: dict
    gpu: str | None = None
    """CUDA_VISIBLE_DEVICES of the worker (None: the doctor's own)."""


# doctor_workers.py writes this line before the traceback of a job that raised (its message is in the result).
TRACEBACK_MARKER = "rlep-doctor: the job raised; its traceback follows"
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch.distributed's prefix on a rank's stderr


def log_tail(text: str) -> list[str]:
    """The last lines of a worker's stderr before any traceback of a job that raised (its message is shown
    apart): what the job logged up to the failure."""
    lines = [_RANK_PREFIX.sub("", line) for line in text.splitlines()]
    if TRACEBACK_MARKER in lines:
        lines = lines[: lines.index(TRACEBACK_MARKER)]
    return lines[-LOG_TAIL_LINES:]


def error_line(lines: list[str]) -> str:
    """The line of a crashed worker's stderr that says what went wrong: its last exception line, else its last."""
    exception = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*:")
    found = [line.strip() for line in lines if exception.match(line.strip())]
    rest = [line.strip() for line in lines if line.strip()]
    return (found or rest or ["no output"])[-1]


def run_workers(workers: list[Worker], timeout_s: float) -> list[Outcome]:
    """Runs `workers` side by side (doctor_workers.py), each in a session of its own; one Outcome each.

    Once one fails the others are stopped (status `skip`): a broadcast peer would otherwise wait out its group's
    timeout for a partner that is gone.
    """
    scratch = Path(tempfile.mkdtemp(prefix="rlep-doctor-"))  # kept when a worker fails: its log is there
    running = [_start(worker, scratch / str(i)) for i, worker in enumerate(workers)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [process.poll() for process, _ in running]
        if None not in codes or any(code not in (None, 0) for code in codes):
            break
        time.sleep(WORKER_POLL_S)
    codes = [process.poll() for process, _ in running]
    failed = any(code not in (None, 0) for code in codes)
    outcomes = []
    for (process, files), code in zip(running, codes, strict=True):
        if code is None:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: a vLLM engine core goes with it
            process.wait()
        log = files / "log"
        tail = log_tail(log.read_text(errors="replace"))
        if code is None and failed:
            outcomes.append(Outcome("skip", "stopped: another worker of this check failed"))
        elif code is None:
            outcomes.append(Outcome("fail", f"no result within {timeout_s:.0f} s (killed)", {}, tail, str(log)))
        else:
            outcomes.append(_reported(files, code, tail))
    if all(outcome.status == "pass" for outcome in outcomes):
        shutil.rmtree(scratch, ignore_errors=True)
    return outcomes


def _start(worker: Worker, files: Path) -> tuple[subprocess.Popen, Path]:
    files.mkdir()
    env = dict(os.environ) | ({"CUDA_VISIBLE_DEVICES": worker.gpu} if worker.gpu is not None else {})
    job = [worker.job, json.dumps(worker.kwargs), str(files / "result.json")]
    with (files / "log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "rlep.services.cli.doctor_workers", *job],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    return process, files


def _reported(files: Path, code: int, tail: list[str]) -> Outcome:
    """What a finished worker reported; a worker that died without a report fails with its log's error line."""
    log = str(files / "log")
    if not (files / "result.json").exists():
        return Outcome("fail", f"exit status {code}: {error_line(tail)}", {}, tail, log)
    reported = json.loads((files / "result.json").read_text())
    if reported["ok"]:
        return Outcome("pass", reported["detail"], reported["values"])
    return Outcome("fail", reported["detail"], reported["values"], tail, log)


def check_learner(node: Node) -> Outcome:
    """One update per visible GPU, side by side (one DeepSpeed engine per process), else one on the CPU."""
    gpus: list[str | None] = list(node.gpus) or [None]
    outcomes = run_workers([Worker("learner", {"model": str(node.model)}, gpu) for gpu in gpus], LEARNER_TIMEOUT_S)
    for gpu, outcome in zip(gpus, outcomes, strict=True):
        if outcome.status == "fail":
            where = f"GPU {gpu}" if gpu is not None else "CPU"
            return replace(outcome, detail=f"{where}: {outcome.detail}")
    if len(outcomes) == 1:
        return outcomes[0]
    return Outcome("pass", f"all {len(outcomes)} GPUs passed; GPU {gpus[0]}: {outcomes[0].detail}", outcomes[0].values)


def check_rollout(node: Node) -> Outcome:
    [outcome] = run_workers([Worker("rollout", {"model": str(node.model)})], ROLLOUT_TIMEOUT_S)
    return outcome


def check_broadcast(node: Node) -> Outcome:
    """NCCL between the first two GPUs, else gloo between two CPU processes (one GPU cannot hold two NCCL ranks)."""
    from rlep.common.ports import free_port

    backend = "nccl" if len(node.gpus) >= 2 else "gloo"
    kwargs = {"model": str(node.model), "port": free_port(), "backend": backend, "timeout_s": BROADCAST_GROUP_TIMEOUT_S}
    gpus = node.gpus[:2] if backend == "nccl" else (None, None)
    send, receive = run_workers(
        [Worker("broadcast-send", kwargs, gpus[0]), Worker("broadcast-receive", kwargs, gpus[1])], BROADCAST_TIMEOUT_S
    )
    for end, outcome in (("sender", send), ("receiver", receive)):
        if outcome.status == "fail":
            return replace(outcome, detail=f"{backend} {end}: {outcome.detail}")
    values = {**send.values, "receiver_digest": receive.values["digest"], "backend": backend}
    if receive.values["digest"] != send.values["digest"]:
        return Outcome("fail", f"{backend}: the received tensors' digest differs from the sent ones'", values)
    where = f"GPUs {gpus[0]} -> {gpus[1]}" if backend == "nccl" else "two CPU processes"
    rate = values["bytes"] / max(values["send_s"], 1e-9) / 2**30
    detail = (
        f"{backend}, {where}: {values['tensors']} tensors, {values['bytes'] / 2**20:.1f} MiB in "
        f"{values['send_s']:.2f} s ({rate:.2f} GiB/s), received equal to sent"
    )
    return Outcome("pass", detail, values)


# -- running and reporting ---------------------------------------------------------------------
CHECKS: dict[str, tuple[str, Callable[[Node], Outcome]]] = {
    "versions": ("versions", check_versions),
    "learner": ("learner update", check_learner),
    "rollout": ("rollout engine", check_rollout),
    "broadcast": ("weight broadcast", check_broadcast),
}


def detect_node(model: Path) -> Node:
    """The visible GPUs as CUDA_VISIBLE_DEVICES entries (the doctor's own list, if it has one)."""
    try:
        import torch
    except ImportError:  # the versions check reports it
        return Node((), model)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    ids = listed[:count] if len(listed) >= count else [str(i) for i in range(count)]
    return Node(tuple(ids), model)


def run_check(name: str, node: Node) -> CheckResult:
    """Runs one check; an exception in the doctor's own process is a failed check with its message."""
    started = time.perf_counter()
    try:
        outcome = CHECKS[name][1](node)
    except Exception as err:  # reported as the check's failure, without a traceback
        outcome = Outcome("fail", f"{type(err).__name__}: {err}")
    seconds = time.perf_counter() - started
    return CheckResult(name, seconds=seconds, **asdict(outcome))


def run_checks(node: Node, skip: set[str], console) -> list[CheckResult]:
    """Every check in order (skipped ones reported as such), with a spinner naming the one running."""
    results = []
    for name, (title, _) in CHECKS.items():
        if name in skip:
            results.append(CheckResult(name, "skip", 0.0, "skipped (--skip)"))
            continue
        with console.status(f"[bold]{title}[/] on {node.label} ..."):
            result = run_check(name, node)
        mark = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]", "skip": "[yellow]skip[/]"}[result.status]
        console.print(f"{mark} {title} ({result.seconds:.1f} s)")
        results.append(result)
    return results


def render(results: list[CheckResult], node: Node, console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"rlep doctor: {node.model} on {node.label}", show_lines=True)
    for column, justify in (("check", "left"), ("status", "left"), ("seconds", "right"), ("detail", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    colours = {"pass": "green", "fail": "red", "skip": "yellow"}
    for result in results:
        status = f"[{colours[result.status]}]{result.status}[/]"
        table.add_row(CHECKS[result.name][0], status, f"{result.seconds:.1f}", Text(result.detail))
    console.print(table)
    for result in (r for r in results if r.log_file):
        title = CHECKS[result.name][0]
        console.print(f"[red]{title}[/]: its worker's whole log is {result.log_file}", highlight=False, soft_wrap=True)
        if result.log_tail:
            console.print("\n".join(result.log_tail), markup=False, highlight=False, soft_wrap=True)


def write_json(path: Path, results: list[CheckResult], node: Node) -> None:
    report = {"model": str(node.model), "gpus": list(node.gpus), "checks": [asdict(r) for r in results]}
    path.write_text(json.dumps(report, indent=2) + "\n")


def summary(results: list[CheckResult]) -> tuple[int, str]:
    """Exit status and the last line: the first failed check, or how many passed."""
    failed = [r for r in results if r.status == "fail"]
    if failed:
        first = failed[0]
        return 1, f"doctor: FAILED {first.name}: {' '.join(first.detail.split())}"
    skipped = sum(r.status == "skip" for r in results)
    return 0, f"doctor: all {len(results) - skipped} checks passed" + (f" ({skipped} skipped)" if skipped else "")


def doctor(
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the results as JSON to this file.")
    ] = None,
    skip: Annotated[
        list[str] | None, typer.Option("--skip", help=f"Leave out a check (repeatable): {', '.join(CHECKS)}.")
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            help="HF checkpoint to run the checks on (default: the tiny model).", exists=True, file_okay=False
        ),
    ] = None,
) -> None:
    """Preflight of this node before a long job: versions, learner update, rollout engine, weight broadcast.

    Each check runs its GPU variant where CUDA is visible, else its CPU variant (docs/doctor.md). Exit status 1
    names the first failed check."""
    from rich.console import Console

    unknown = sorted(set(skip or ()) - CHECKS.keys())
    if unknown:
        raise typer.BadParameter(
            f"unknown check {', '.join(unknown)}; choose from {', '.join(CHECKS)}", param_hint="--skip"
        )
    if model is None:
        from rlep.common.tiny_model import cached_model

        model = cached_model("tiny")
    console = Console()
    node = detect_node(model.resolve())
    results = run_checks(node, set(skip or ()), console)
    render(results, node, console)
    if json_path is not None:
        write_json(json_path, results, node)
    code, line = summary(results)
    typer.echo(line, err=code != 0)
    raise typer.Exit(code)
