"""Power cuts under replay's embedded Redis: its data directory on a file system that loses what was not fsynced.

The file system is tests/power_cut_fs.py (FUSE, via mfusepy). Replay starts as the service does with no Redis URL
(`start_replay` -> `start_local_redis` on `local_redis_dir`); writers add trajectories over gRPC until the file
system cuts at an armed sync; then redis-server is SIGKILLed, the mount is dropped and remounted from its durable
state, and replay restarts on it. Where FUSE cannot mount (no /dev/fuse, no fusermount3 or libfuse3, no permission
in a container), the tests skip with the reason.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rlep.common.config import ServerConfig
from rlep.common.types import Trajectory, Verdict
from rlep.services.replay.client import ReplayClient
from rlep.services.replay.config import ReplayConfig
from rlep.services.replay.main import RunningReplay, start_replay
from tests.power_cut_fs import MountFailed, PowerCutMount

pytestmark = pytest.mark.integration

POOL = "power-cut"
WRITERS = 4  # concurrent adds: Redis then acknowledges several per fsync, and some are in flight at the cut
SYNCS_BEFORE_CUT = 300  # ~500 acknowledged adds, ~2.5 s, with `appendfsync always` (several adds share an fsync)
MAX_ACKS = 3_000  # writers stop here when no armed cut came (no fsyncs: durability broken); the test cuts then


def why_no_fuse() -> str | None:
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse (FUSE is not available here)"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (Debian: apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401 - raises where libfuse3 is missing
    except (ImportError, OSError) as err:
        return f"mfusepy cannot load libfuse ({err}); pip install mfusepy, apt-get install fuse3"
    return None


@pytest.fixture
def power_cut_fs(tmp_path) -> Iterator[PowerCutMount]:
    reason = why_no_fuse()
    if reason:
        pytest.skip(reason)
    fs = PowerCutMount(tmp_path / "state", tmp_path / "mnt")
    try:
        fs.mount()
    except MountFailed as err:
        pytest.skip(str(err))  # e.g. a container without the right to mount
    yield fs
    fs.unmount()


def start_on(fs: PowerCutMount, appendfsync: str) -> RunningReplay:
    """Replay as the service starts it with no Redis URL: an embedded Redis on a data directory (here the mount)."""
    config = ReplayConfig(
        server=ServerConfig(port=0), local_redis_dir=fs.mountpoint / "redis", local_redis_appendfsync=appendfsync
    )
    return start_replay(config)


def trajectory(i: int) -> Trajectory:
    return Trajectory(f"q{i}", f"answer {i}", 1.0, verdict=Verdict.CORRECT)


def add_until_cut(fs: PowerCutMount, running: RunningReplay) -> tuple[set[int], int]:
    """WRITERS threads add one trajectory per call (question q<i>) until a call fails (the armed cut came) or
    MAX_ACKS adds were acknowledged; then the power goes, if it has not. Returns the acknowledged ids and how many
    ids were tried."""
    acknowledged: set[int] = set()

    def writer(first: int) -> None:
        with ReplayClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            for i in range(first, 2 * MAX_ACKS, WRITERS):
                if len(acknowledged) >= MAX_ACKS:
                    return
                try:
                    client.add(POOL, [trajectory(i)])
                except grpc.RpcError:
                    return  # the cut: Redis exited (always) or refuses writes (everysec)
                acknowledged.add(i)

    threads = [threading.Thread(target=writer, args=(first,)) for first in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fs.arm(0)
    return acknowledged, max(acknowledged, default=0) + WRITERS + 1


def power_off(fs: PowerCutMount, running: RunningReplay) -> None:
    """After the cut: redis-server SIGKILLed (its supervisor's restarts fail, every sync does), replay stopped, the
    mount dropped."""
    if running.local_redis is not None:
        running.local_redis.process.kill()
    running.stop()
    fs.unmount()


def stored_ids(running: RunningReplay, tried: int) -> set[int]:
    with ReplayClient(f"127.0.0.1:{running.port}", timeout_s=30) as client:
        if POOL not in client.list_pools():
            return set()  # the cut took the pool's creation too
        found = client.sample(POOL, [f"q{i}" for i in range(tried)], m=1)
        assert client.stats(POOL).trajectories == sum(len(successes) for successes in found.values())
    return {int(question_id[1:]) for question_id, successes in found.items() if successes}


def cut_during_adds(fs: PowerCutMount, appendfsync: str, syncs_before_cut: int) -> tuple[set[int], set[int]]:
    """Adds until the armed cut, restarts on what survived; returns (acknowledged ids, stored ids)."""
    running = start_on(fs, appendfsync)
    fs.arm(syncs_before_cut)
    acknowledged, tried = add_until_cut(fs, running)
    power_off(fs, running)
    fs.mount()
    restarted = start_on(fs, appendfsync)
    try:
        return acknowledged, stored_ids(restarted, tried)
    finally:
        restarted.stop()


def test_appendfsync_always_keeps_every_acknowledged_add_across_a_power_cut(power_cut_fs):
    acknowledged, stored = cut_during_adds(power_cut_fs, "always", SYNCS_BEFORE_CUT)
    lost = acknowledged - stored
    assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged adds lost: {sorted(lost)[:10]}"
    assert 100 <= len(acknowledged) < MAX_ACKS, len(acknowledged)  # the armed cut came, after real work
    # Stored but never acknowledged: adds in flight at the cut (their fsync had begun). Allowed, and few.
    assert len(stored - acknowledged) <= WRITERS


def test_the_harness_sees_loss_appendfsync_everysec_loses_acknowledged_adds(power_cut_fs):
    """The control: everysec acknowledges an add before its fsync, so a cut before the next fsync loses it. The power
    goes as the adds begin (every sync from then on fails), so every add it acknowledges is lost, deterministically."""
    acknowledged, stored = cut_during_adds(power_cut_fs, "everysec", 0)
    assert acknowledged, "no add was acknowledged before the cut"
    assert acknowledged - stored == acknowledged, (len(acknowledged), len(stored))


def test_a_cut_at_any_sync_of_a_first_start_or_right_after_it_recovers(power_cut_fs, tmp_path):
    """A fresh data directory's first start (password file, config, Redis's AOF directory and manifest) cut at each of
    its syncs in turn, and right after it: the restart comes up, with a password, and serves adds."""
    running = start_on(power_cut_fs, "always")
    syncs_in_first_start = power_cut_fs.state()["syncs"]
    running.stop()
    assert syncs_in_first_start >= 3  # Redis's AOF files, manifest and directory; the password and config add more
    for cut_at in range(syncs_in_first_start + 1):  # the last: a cut right after a completed first start
        fs = PowerCutMount(tmp_path / f"state-{cut_at}", tmp_path / f"mnt-{cut_at}")
        fs.mount()
        try:
            fs.arm(cut_at)
            try:
                running = start_on(fs, "always")
            except (OSError, RuntimeError):  # the cut hit this start: what it left on disk is the point
                assert fs.state()["cut"], "a start failed with no cut"
                fs.unmount()
            else:
                fs.arm(0)  # the power goes right after the start (or at once, where the cut already came)
                power_off(fs, running)
            fs.mount()
            restarted = start_on(fs, "always")
            try:
                with ReplayClient(f"127.0.0.1:{restarted.port}", timeout_s=10) as client:
                    assert client.add(POOL, [trajectory(1)]).added == 1
                    assert client.stats(POOL).trajectories == 1, cut_at
            finally:
                restarted.stop()
            assert (fs.mountpoint / "redis" / "redis.password").read_text().strip()
        finally:
            fs.unmount()
