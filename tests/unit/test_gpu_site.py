"""scripts/gpu_site.py's choice of the carried wheels a GPU machine needs, against this virtualenv's real packages as
the machine's: rlep and deepspeed always; a library when the machine lacks it or its version fails a requirement of
what is installed, requirements of wheels brought in counting too; the machine's own kept otherwise."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.unit.test_architecture import ROOT

SCRIPT = ROOT / "scripts" / "gpu_site.py"


def make_wheel(folder: Path, name: str, version: str, *requires: str, files: dict[str, bytes] | None = None) -> None:
    """A wheel file with the METADATA the script reads, and `files` (path in the wheel: content)."""
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
        for path, content in (files or {}).items():
            archive.writestr(path, content)


def needed(folder: Path) -> tuple[set[str], str]:
    done = subprocess.run([sys.executable, SCRIPT, "needed", folder], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return {Path(line).name.split("-")[0] for line in done.stdout.split()}, done.stderr


def test_installs_what_the_machine_lacks_or_has_too_old_and_keeps_the_rest(tmp_path):
    # Here packaging 26.x, idna 3.x, hjson 3.1 and einops 0.8 are installed: they stand for the machine's packages.
    make_wheel(
        tmp_path, "rlep", "0.1.0", "packaging>=99", "libx", "hjson>=3", "absent-lib>=1", 'extra-lib; extra == "x"'
    )
    make_wheel(tmp_path, "deepspeed", "0.19.8", "einops")
    make_wheel(tmp_path, "packaging", "99.0")  # the machine's is too old for rlep
    make_wheel(tmp_path, "hjson", "3.1.0")  # the machine's will do
    make_wheel(tmp_path, "einops", "0.8.2")
    make_wheel(tmp_path, "libx", "1.0", "idna==0.1")  # the machine lacks it; once installed, its pin counts
    make_wheel(tmp_path, "idna", "0.1")

    install, table = needed(tmp_path)

    assert install == {"rlep", "deepspeed", "packaging", "libx", "idna"}
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert rows["hjson"].endswith("machine's kept") and rows["einops"].endswith("machine's kept")
    assert rows["idna"].endswith("install 0.1") and "==0.1" in rows["idna"]
    assert rows["absent-lib"].endswith("not carried, absent")
    assert "extra-lib" not in rows  # an extra's requirement is not the learner's


def test_refuses_a_folder_without_the_project_or_deepspeed(tmp_path):
    make_wheel(tmp_path, "rlep", "0.1.0")
    done = subprocess.run([sys.executable, SCRIPT, "needed", tmp_path], capture_output=True, text=True)
    assert done.returncode != 0 and "no wheel of deepspeed" in done.stderr and "make gpu-wheels" in done.stderr


def test_refuses_a_project_wheel_older_than_the_checkout(tmp_path):
    """Files map back through pyproject's package-dir (rlep.services is services/, rlep itself proto/rlep/)."""
    same = {
        "rlep/services/learner/policy.py": (ROOT / "services/learner/policy.py").read_bytes(),
        "rlep/replay/v1/replay.proto": (ROOT / "proto/rlep/replay/v1/replay.proto").read_bytes(),
    }
    make_wheel(tmp_path, "deepspeed", "0.19.8")
    make_wheel(tmp_path, "rlep", "0.1.0", files=same)
    assert needed(tmp_path)[0] == {"rlep", "deepspeed"}

    make_wheel(tmp_path, "rlep", "0.1.0", files=same | {"rlep/common/files.py": b"# an older version\n"})
    done = subprocess.run([sys.executable, SCRIPT, "needed", tmp_path], capture_output=True, text=True)
    assert done.returncode != 0 and "older than the checkout (rlep_common/files.py)" in done.stderr
