"""A rollout replica as operators start it (`rlep serve rollout` in a process of its own), for the benchmarks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from rlep.common.health import wait_serving

START_TIMEOUT_S = 900.0  # a vLLM-CPU replica loads and compiles its sampler in 35-90 s; a large model takes longer


def start_worker(args, model: str, port: int, eager: bool = False) -> subprocess.Popen:
    """Starts a replica of `model` on 127.0.0.1:`port` and returns once it serves (`args.eager`: no CUDA graphs)."""
    script = Path(sys.executable).with_name("rlep")
    cmd = [str(script) if script.exists() else shutil.which("rlep") or "rlep", "serve", "rollout", "--port", str(port)]
    cmd += ["--set", f"engine.model={model}", "--set", f"engine.enforce_eager={str(args.eager or eager).lower()}"]
    cmd += ["--set", "engine.max_num_seqs=256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process=proc)
    return proc
