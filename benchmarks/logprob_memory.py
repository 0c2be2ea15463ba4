"""Logprob/entropy memory: one micro-batch's forward + backward, full log-softmax (old) vs chunked LM head (new).

A head `Linear(hidden, vocab)` over hidden states `[rows, length, hidden]` (requiring grad, like a
decoder's output) stands in for the policy's last layer. Each variant runs what one micro-batch of
`DeepSpeedPolicy.update` runs there, backward of `sum(logprobs * weights)` included:

- old: full logits `[N, L, V]`, a float32 log-softmax of them for the logprobs, and after backward
  a second one for the entropy (a copy of the learner's previous code is kept below);
- new: `rlep.services.learner.batch.token_scores`, the head applied `--chunk` positions at a time under
  activation checkpointing, logprobs and entropy from one pass.

Peak memory is measured as resident memory (RSS), which is what runs out on a CPU machine, and
torch's CPU allocator has no peak counter of its own. Each variant runs in a fresh subprocess
(so one variant's allocations and lazy imports never count in the other's figure) with
`MALLOC_MMAP_THRESHOLD_=1 MiB`, so freed blocks go back to the OS and RSS follows live tensors. It
builds its inputs, runs once to warm up (first use of checkpointing imports ~150 MB of modules),
resets the kernel's high-water mark (`/proc/self/clear_refs` <- 5), runs `--repeats` more times and
reports VmHWM minus the RSS before them (`ru_maxrss` where the reset is refused). Time per token is
the mean of those runs; the machine may be shared, so take timings as rough.

The old variant peaks at ~4 float32 copies of the logits (9.3 GiB measured at 1 x 4096 x 151,936), so
the compared micro-batch defaults to 1 row (the learner's default is 8 rows: ~74 GiB in the old
code). The script refuses to start a variant whose estimate (5 copies; 5 chunk-sized blocks for the
new one) exceeds 70% of MemAvailable. The new variant also runs at `--new-rows` rows to show that
its peak does not grow with the batch.

    python benchmarks/logprob_memory.py [--rows 1] [--length 4096] [--vocab 151936] [--hidden 64]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1024**3


def old_token_logprobs(logits, tokens):
    """The learner's previous `token_logprobs`: a float32 log-softmax over the full vocabulary."""
    import torch

    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def old_token_entropy(logits):
    """The learner's previous `token_entropy`: a second full log-softmax."""
    import torch

    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def old_step(head, states, tokens, weights, chunk: int) -> None:
    """As the previous `DeepSpeedPolicy.update` did per micro-batch (logits kept for the entropy after backward)."""
    import torch

    logits = head(states)  # [N, L, V]
    logprobs = old_token_logprobs(logits, tokens)
    (logprobs * weights).sum().backward()
    with torch.no_grad():
        old_token_entropy(logits.detach())


def new_step(head, states, tokens, weights, chunk: int) -> None:
    from rlep.services.learner.batch import token_scores  # imported before the measurement starts

    logprobs, _ = token_scores(states, head, tokens, chunk_positions=chunk)
    (logprobs * weights).sum().backward()


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def run_variant(args: argparse.Namespace) -> dict:
    """Runs in the subprocess: one variant, its peak resident memory above the inputs, its time per token."""
    import torch

    import rlep.services.learner.batch  # noqa: F401  (its imports must not count as the new variant's memory)

    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    states = torch.randn(args.rows, args.length, args.hidden, requires_grad=True)
    tokens = torch.randint(0, args.vocab, (args.rows, args.length))
    weights = torch.randn(args.rows, args.length - 1)
    step = old_step if args.variant == "old" else new_step

    def run() -> float:
        head.zero_grad(set_to_none=True)
        states.grad = None
        start = time.perf_counter()
        step(head, states, tokens, weights, args.chunk)
        return time.perf_counter() - start

    run()  # warm-up: lazy imports and thread pools are not the variant's memory
    before = _status_bytes("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        high_water = lambda: _status_bytes("VmHWM")  # noqa: E731
    except OSError:
        high_water = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    seconds = [run() for _ in range(args.repeats)]
    return {"peak_bytes": high_water() - before, "s_per_token": sum(seconds) / len(seconds) / (args.rows * args.length)}


def estimated_bytes(variant: str, rows: int, length: int, vocab: int, chunk: int) -> int:
    if variant == "old":
        return 5 * rows * length * vocab * 4
    return 5 * min(chunk, rows * length) * vocab * 4


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def measure(variant: str, rows: int, args: argparse.Namespace, console: Console) -> dict | None:
    estimate = estimated_bytes(variant, rows, args.length, args.vocab, args.chunk)
    if estimate > 0.7 * mem_available():
        console.print(f"[yellow]skipped {variant} at {rows} rows: needs ~{estimate / GIB:.1f} GiB[/]")
        return None
    command = [sys.executable, __file__, "--variant", variant, "--rows", str(rows)]
    for name in ("length", "vocab", "hidden", "chunk", "repeats"):
        command += [f"--{name}", str(getattr(args, name))]
    # Blocks above 1 MiB are mmapped and go back to the OS when freed, so the high-water mark follows
    # live tensors (glibc does that by itself only above its dynamic threshold, up to 32 MiB).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    with console.status(f"{variant}, {rows} x {args.length} tokens (~{estimate / GIB:.1f} GiB)"):
        out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1, help="rows of the compared micro-batch")
    parser.add_argument("--new-rows", type=int, default=8, help="rows of the extra new-only run (0 = none)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=1024, help="positions per chunk of the new method")
    parser.add_argument("--repeats", type=int, default=2, help="measured runs, after one warm-up run")
    parser.add_argument("--variant", choices=["old", "new"], help=argparse.SUPPRESS)  # subprocess mode
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    console = Console()
    old = measure("old", args.rows, args, console)
    new = measure("new", args.rows, args, console)
    runs = [("old: full log-softmax", args.rows, old), (f"new: chunks of {args.chunk}", args.rows, new)]
    if args.new_rows and args.new_rows != args.rows:
        runs.append((f"new: chunks of {args.chunk}", args.new_rows, measure("new", args.new_rows, args, console)))
    table = Table(title=f"logprobs + entropy, forward + backward, vocab {args.vocab:,}, hidden {args.hidden}")
    for column in ("method", "tokens", "peak memory", "time per token"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name, rows, result in runs:
        if result is not None:
            peak, per_token = result["peak_bytes"] / GIB, result["s_per_token"] * 1e6
            table.add_row(name, f"{rows} x {args.length}", f"{peak:.2f} GiB", f"{per_token:.1f} us")
    if old and new:
        ratio = new["peak_bytes"] / old["peak_bytes"]
        table.add_row(
            r"ratio new / old  \[goal <= 0.25]", "", f"{ratio:.3f}", f"{new['s_per_token'] / old['s_per_token']:.2f}x"
        )
    console.print(table)


if __name__ == "__main__":
    main()
