"""A JIT-build lock left by a dead process is removed; one a live process holds is kept."""

from __future__ import annotations

import subprocess
import sys

from rlep.services.learner.jit_locks import BATON_NAME, clear_stale_jit_locks


def test_a_lock_nobody_holds_is_removed_at_either_depth(tmp_path):
    # <root>/<extension>/lock (TORCH_EXTENSIONS_DIR set) and <root>/py311_cpu/<extension>/lock (torch's default).
    shallow = tmp_path / "deepspeed_shm_comm" / BATON_NAME
    deep = tmp_path / "py311_cpu" / "fused_adam" / BATON_NAME
    for baton in (shallow, deep):
        baton.parent.mkdir(parents=True)
        baton.touch()
    (tmp_path / "py311_cpu" / "fused_adam" / "fused_adam.so").touch()

    assert sorted(clear_stale_jit_locks(tmp_path)) == sorted([shallow, deep])
    assert not shallow.exists() and not deep.exists()
    assert (tmp_path / "py311_cpu" / "fused_adam" / "fused_adam.so").exists()  # only the locks go


def test_a_lock_a_live_process_holds_open_is_kept(tmp_path):
    baton = tmp_path / "deepspeed_shm_comm" / BATON_NAME
    baton.parent.mkdir()
    # As torch's FileBaton does: create the file exclusively and keep its descriptor open while building.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); "
            "sys.stdin.read()",
            str(baton),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert clear_stale_jit_locks(tmp_path) == []
        assert baton.exists()
    finally:
        holder.stdin.close()  # the holder exits: its lock is now stale
        holder.wait(timeout=30)
    assert clear_stale_jit_locks(tmp_path) == [baton]


def test_nothing_to_do_without_the_folder(tmp_path):
    assert clear_stale_jit_locks(tmp_path / "absent") == []
