"""Payload files in shared memory: a dead maker's are swept, a live maker's never (services/weights/staging.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from rlep.services.weights.payload import write_payload
from rlep.services.weights.staging import OWNER_PREFIX, PUSH_PREFIX, WORKER_PREFIX, staged_file, sweep_stale

# A process that stages a payload the way the worker does, says where, and waits to be killed.
MAKER = textwrap.dedent(
    """
    import os, sys, time
    from rlep.services.weights.staging import WORKER_PREFIX, staged_file
    with staged_file(sys.argv[1], WORKER_PREFIX) as (fd, path):
        os.write(fd, b"x" * 4096)
        print(path, flush=True)
        time.sleep(600)
    """
)


def test_a_killed_makers_payload_is_swept_and_a_live_ones_is_kept(tmp_path):
    maker = subprocess.Popen([sys.executable, "-c", MAKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        dead_path = maker.stdout.readline().strip()
        assert dead_path and os.path.exists(dead_path)
        # While its maker lives, nobody removes it.
        assert sweep_stale([tmp_path]) == [] and os.path.exists(dead_path)
    finally:
        maker.send_signal(signal.SIGKILL)
        maker.wait()
    stranger = tmp_path / "rlep-weights-notes.txt"  # our prefix, but not named by staged_file
    stranger.write_text("keep")
    with staged_file(tmp_path, PUSH_PREFIX) as (_, live_path):
        # safetensors' save_file replaces the file (a new inode): ownership must survive that.
        write_payload({"w": torch.ones(16)}, live_path)
        removed = sweep_stale([tmp_path, str(tmp_path)])
        assert [str(p) for p in removed] == [dead_path]
        assert not os.path.exists(dead_path) and live_path.exists() and stranger.exists()
    assert not live_path.exists()


def test_owner_files_of_dead_makers_are_collected_once_old(tmp_path):
    dead_owner = tmp_path / f"{OWNER_PREFIX}999999-0badf00d"
    dead_owner.write_bytes(b"")
    orphan = tmp_path / f"{WORKER_PREFIX}999999-0badf00d-abc.safetensors"
    orphan.write_bytes(b"x")
    fresh_owner = tmp_path / f"{OWNER_PREFIX}999998-0badf00d"
    fresh_owner.write_bytes(b"")
    os.utime(dead_owner, (0, 0))
    assert sweep_stale([tmp_path]) == [orphan]
    # The old unlocked owner file goes; a fresh one may belong to a process about to lock it.
    assert not dead_owner.exists() and fresh_owner.exists()
