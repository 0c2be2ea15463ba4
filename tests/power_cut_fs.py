"""A FUSE file system for power-cut tests: a passthrough that loses, at a cut, everything not fsynced.

What a cut keeps (the model):
- File data: a file's bytes as of its last fsync/fdatasync; a file never synced comes back empty.
- Names (create, rename, unlink, mkdir, rmdir) are ordered, as in a metadata journal: any sync (of a file or a
  directory) makes every name change made before it durable. So a file renamed into place without a sync of its
  data comes back under the new name but empty (the zero-length-file-after-crash case). This is harsher than ext4's
  default data=ordered, which writes a new file's data before the metadata that names it.
- At the cut the sync in flight fails (EIO), and so does every later one: the power is gone and nothing more can
  become durable. Other operations go on in memory so processes can wind down; remounting discards them.
- Not modeled: hard links, symlinks, xattrs (refused), owners and timestamps (not kept), a write torn inside one
  write() call, a disk that reorders or ignores flushes.

How: programs see `<state>/live`, a plain directory rebuilt at every mount from `<state>/durable` (tree.json: each
path's inode key and mode; data/<key>: that inode's bytes at its last sync). A sync copies the file to data/<key>,
then writes tree.json, each by temporary file and rename, so killing the daemon at any instant leaves the durable
state of the last completed sync. The test arms the cut with `setxattr(mount, ARM_XATTR, b"N")`: N more syncs
complete, the next one is the cut (N=0: cut now). `getxattr(mount, STATE_XATTR)` says how many syncs completed
since mount and whether the cut happened.

Run as `python tests/power_cut_fs.py STATE_DIR MOUNTPOINT` (foreground); `PowerCutMount` does that for tests.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

ARM_XATTR = "user.power_cut.syncs_before_cut"
STATE_XATTR = "user.power_cut.state"
TREE_FILE = "tree.json"
MOUNT_TIMEOUT_S = 10.0  # the daemon mounts in ~0.2 s; a loaded CI machine is slower
STAT_FIELDS = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_blocks")


def _replace_with(path: Path, data: bytes) -> None:
    """Writes `path` whole or not at all as far as the daemon's death goes (it survives a daemon kill, which is the
    only cut this file system has, so no fsync of its own)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def _run_daemon(state_dir: Path, mountpoint: Path) -> None:
    import mfusepy

    class PowerCutFS(mfusepy.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.live, self.durable = state_dir / "live", state_dir / "durable"
            self.keys: dict[int, int] = {}  # live inode number -> durable key
            self.syncs, self.syncs_before_cut, self.cut = 0, None, False
            self._restore()

        def _restore(self) -> None:
            """Rebuilds the live tree from the durable state: what survived the last cut."""
            shutil.rmtree(self.live, ignore_errors=True)
            self.live.mkdir(parents=True)
            (self.durable / "data").mkdir(parents=True, exist_ok=True)
            tree_path = self.durable / TREE_FILE
            tree = json.loads(tree_path.read_text()) if tree_path.exists() else {"dirs": {}, "files": {}}
            for rel, mode in sorted(tree["dirs"].items()):  # a parent sorts before its children
                (self.live / rel).mkdir()
                os.chmod(self.live / rel, mode)
            for rel, (key, mode) in tree["files"].items():
                data = self.durable / "data" / str(key)
                (self.live / rel).write_bytes(data.read_bytes() if data.exists() else b"")
                os.chmod(self.live / rel, mode)
                self.keys[os.lstat(self.live / rel).st_ino] = key
            self.next_key = max(self.keys.values(), default=-1) + 1

        def _path(self, path: str) -> str:
            return os.path.join(self.live, path.lstrip("/"))

        def _key(self, ino: int) -> int:
            if ino not in self.keys:
                self.keys[ino], self.next_key = self.next_key, self.next_key + 1
            return self.keys[ino]

        def _forget_if_last_link(self, path: str) -> None:
            """Called before a name goes: a freed inode number may be reused by a new file, which needs a new key."""
            try:
                st = os.lstat(self._path(path))
            except FileNotFoundError:
                return
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                self.keys.pop(st.st_ino, None)

        def _sync(self, fh: int | None) -> None:
            if self.syncs_before_cut == 0:
                self.cut = True
            if self.cut:
                raise mfusepy.FuseOSError(errno.EIO)
            if self.syncs_before_cut is not None:
                self.syncs_before_cut -= 1
            if fh is not None:
                st = os.fstat(fh)
                _replace_with(self.durable / "data" / str(self._key(st.st_ino)), os.pread(fh, st.st_size, 0))
            dirs, files = {}, {}
            for root, dirnames, filenames in os.walk(self.live):
                for name in dirnames + filenames:
                    st = os.lstat(os.path.join(root, name))
                    rel = os.path.relpath(os.path.join(root, name), self.live)
                    if stat.S_ISDIR(st.st_mode):
                        dirs[rel] = stat.S_IMODE(st.st_mode)
                    else:
                        files[rel] = [self._key(st.st_ino), stat.S_IMODE(st.st_mode)]
            _replace_with(self.durable / TREE_FILE, json.dumps({"dirs": dirs, "files": files}).encode())
            self.syncs += 1

        def getattr(self, path, fh=None):
            st = os.fstat(fh) if fh is not None else os.lstat(self._path(path))
            attrs = {name: getattr(st, name) for name in STAT_FIELDS}
            return attrs | {"st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

        def readdir(self, path, fh):
            return [".", "..", *os.listdir(self._path(path))]

        def open(self, path, flags):
            # Always readable (a sync reads the file back) and never O_APPEND: the kernel passes each write's offset.
            return os.open(self._path(path), (flags & ~(os.O_ACCMODE | os.O_APPEND)) | os.O_RDWR)

        def create(self, path, mode, flags):
            return os.open(self._path(path), (flags & ~(os.O_ACCMODE | os.O_APPEND)) | os.O_RDWR | os.O_CREAT, mode)

        def read(self, path, size, offset, fh):
            return os.pread(fh, size, offset)

        def write(self, path, data, offset, fh):
            return os.pwrite(fh, data, offset)

        def truncate(self, path, length, fh=None):
            os.truncate(fh if fh is not None else self._path(path), length)

        def flush(self, path, fh):
            return 0

        def release(self, path, fh):
            os.close(fh)

        def fsync(self, path, datasync, fh):
            self._sync(fh)

        def fsyncdir(self, path, datasync, fh):
            self._sync(None)

        def mkdir(self, path, mode):
            os.mkdir(self._path(path), mode)

        def rmdir(self, path):
            os.rmdir(self._path(path))

        def unlink(self, path):
            self._forget_if_last_link(path)
            os.unlink(self._path(path))

        def rename(self, old, new):
            self._forget_if_last_link(new)
            os.rename(self._path(old), self._path(new))

        def chmod(self, path, mode):
            if path is not None:  # None: an unlinked file still open; its mode is kept nowhere
                os.chmod(self._path(path), mode)

        def chown(self, path, uid, gid):
            return 0  # owners are not kept

        def utimens(self, path, times=None):
            if path is not None:
                os.utime(self._path(path), ns=times)

        def statfs(self, path):
            st = os.statvfs(self.live)
            names = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_namemax")
            return {name: getattr(st, name) for name in names}

        def setxattr(self, path, name, value, options, position=0):
            if path != "/" or name != ARM_XATTR:
                raise mfusepy.FuseOSError(errno.ENOTSUP)
            self.syncs_before_cut = int(value)
            self.cut = self.cut or self.syncs_before_cut == 0  # nothing can become durable from now on

        def getxattr(self, path, name, position=0):
            if path != "/" or name != STATE_XATTR:
                raise mfusepy.FuseOSError(errno.ENODATA)
            return json.dumps({"syncs": self.syncs, "cut": self.cut}).encode()

    # One thread: operations never interleave, so the sync counter and the durable state need no lock.
    # hard_remove: an unlinked open file is dropped, not renamed to .fuse_hidden* (which a sync would make durable).
    mfusepy.FUSE(PowerCutFS(), str(mountpoint), foreground=True, nothreads=True, hard_remove=True, fsname="power_cut")


class MountFailed(RuntimeError):
    """The daemon exited before its file system was mounted (the message quotes its output)."""


class PowerCutMount:
    """The file system, mounted at `mountpoint` by a daemon process of its own over `state_dir`."""

    def __init__(self, state_dir: Path, mountpoint: Path):
        self.state_dir, self.mountpoint = state_dir, mountpoint
        self.log = state_dir / "daemon.log"
        self.process: subprocess.Popen | None = None

    def mount(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log_out:
            args = [sys.executable, __file__, str(self.state_dir), str(self.mountpoint)]
            self.process = subprocess.Popen(args, stdout=log_out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(self.mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.unmount()
                tail = self.log.read_text(errors="replace").strip().splitlines()[-6:]
                raise MountFailed(f"the power-cut file system did not mount: {' | '.join(tail) or 'no output'}")
            time.sleep(0.02)

    def arm(self, syncs_before_cut: int) -> None:
        """`syncs_before_cut` more syncs complete; the one after is the cut (0: every sync from now on fails)."""
        os.setxattr(self.mountpoint, ARM_XATTR, str(syncs_before_cut).encode())

    def state(self) -> dict:
        """{"syncs": syncs completed since mount, "cut": whether the cut happened}."""
        return json.loads(os.getxattr(self.mountpoint, STATE_XATTR))

    def unmount(self) -> None:
        """Ends the daemon (SIGKILL: nothing more is written to the durable state) and detaches the mount, even with
        files still open on it (lazily). Safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        if os.path.ismount(self.mountpoint) or self.process is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, check=False)
        self.process = None


if __name__ == "__main__":
    _run_daemon(Path(sys.argv[1]), Path(sys.argv[2]))
