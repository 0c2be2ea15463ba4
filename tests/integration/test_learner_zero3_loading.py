"""ZeRO-3 loads the model partitioned from the start (deepspeed.zero.Init through transformers' DeepSpeed
integration), so no learner process holds the whole model in host memory, and the partitions hold the checkpoint's
weights, not a fresh initialisation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

PROBE = Path(__file__).with_name("zero3_loading_probe.py")


def probe(model_dir: Path, stage: int) -> dict:
    done = subprocess.run(
        [sys.executable, str(PROBE), str(model_dir), str(stage)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rlep.common.tiny_model import cached_model

    return cached_model("tiny")


def test_zero3_builds_every_parameter_partitioned_with_the_checkpoints_weights(model_dir):
    result = probe(model_dir, 3)
    assert result["partitioned"] and all(result["partitioned"])
    assert result["equal"] and all(result["equal"])
    assert result["zero3_left_on"] is False  # a later stage-2 load in the same process gets plain parameters


def test_zero2_loads_plain_parameters(model_dir):
    result = probe(model_dir, 2)
    assert not any(result["partitioned"]) and all(result["equal"])
