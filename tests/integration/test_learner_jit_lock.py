"""A learner process starts although a dead process left DeepSpeed's JIT-build lock behind (a CI run once hung
for 90 minutes at its first learner start; torch waits for such a lock with no bound)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from rlep.common.ports import free_port
from rlep.services.learner.jit_locks import BATON_NAME, torch_extensions_root

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOIN = """
import sys
from rlep.services.learner.deepspeed_setup import init_distributed
init_distributed(0, 1, "127.0.0.1", int(sys.argv[1]))
print("joined", flush=True)
"""


def test_a_learner_joins_its_process_group_past_a_dead_builders_lock(tmp_path):
    extensions = tmp_path / "torch_extensions"
    # DeepSpeed's shm op as this machine built it (mtimes kept, so ninja finds it up to date), else built afresh.
    built = next(iter(torch_extensions_root().glob("*/deepspeed_shm_comm")), None)
    if built is not None:
        shutil.copytree(built, extensions / "deepspeed_shm_comm")
    baton = extensions / "deepspeed_shm_comm" / BATON_NAME
    baton.parent.mkdir(parents=True, exist_ok=True)
    baton.touch()  # as a builder SIGKILLed mid-build leaves it: created, never removed, held by no one

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu"}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run(
        [sys.executable, "-c", JOIN, str(free_port())], env=env, capture_output=True, text=True, timeout=420
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "joined" in done.stdout
    assert f"removed {baton}" in done.stderr  # said, not silent
    assert not baton.exists()
