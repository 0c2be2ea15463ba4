"""benchmarks/learner_gpu.py --tiny on CPU (DeepSpeed over gloo): both sides train, and its figures add up.

The GPU shapes run the same code; this keeps the script from rotting where no GPU is available.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "learner_gpu.py"


def test_tiny_benchmark_trains_both_sides(tmp_path):
    out = tmp_path / "tiny.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "project / raw" in run.stdout  # the table
    report = json.loads(out.read_text())
    raw, project = report["sides"]["raw"], report["sides"]["project"]
    assert raw["tokens"] == project["tokens"] > 0  # one batch, real tokens only
    for side in (raw, project):
        assert side["tokens_per_s"] > 0 and side["update_s"] > 0
        assert side["mfu"] is None  # no peak FLOP/s on CPU
        assert len(side["steps"]) == 2  # warm-up + 1 timed step
        assert all(math.isfinite(step["loss"]) for step in side["steps"])
        assert side["weight_change_l2"] > 0
        assert side["imported"] == {"ray": False, "vllm": False}  # the GPU machine has neither
    assert report["ratio"]["tokens_per_s"] == pytest.approx(project["tokens_per_s"] / raw["tokens_per_s"])
    assert project["logprob_s"] > 0 and project["logprob_over_update"] > 0
    assert project["gather_s"] is not None and raw["gather_s"] is None
    # Same weights, batch, micro-batches and optimizer in float32: the two sides' steps agree.
    assert project["steps"][-1]["loss"] == pytest.approx(raw["steps"][-1]["loss"], rel=1e-4)
    assert project["weight_change_l2"] == pytest.approx(raw["weight_change_l2"], rel=1e-3)
