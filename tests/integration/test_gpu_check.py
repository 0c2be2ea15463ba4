"""The GPU check's install step works from the carried wheels alone (scripts/gpu-check.sh, docs/gpu.md §4).

scripts/gpu-wheels.sh (what `make gpu-wheels` runs) builds the wheels for this machine's Python; a fresh virtualenv
that sees only what the GPU machine has (torch, transformers, peft and the rest of the list in docs/gpu.md, with
their requirements, less every distribution the wheels carry) installs them offline with `--install-only` and imports
the learner. The later steps' entry points then run there: pytest collects tests/gpu with the check's options, and the
paths probe runs three of its cases on the CPU. The wheels come from the package index (CI has PyPI): slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from tests.unit.test_architecture import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# What the GPU machine has that the learner uses (docs/gpu.md). grpcio and protobuf are there
# too, at versions unknown here: the wheels carry both, so here they come from the wheels.
GPU_MACHINE_HAS = ("torch", "transformers", "peft", "accelerate", "safetensors", "pyyaml", "rich", "typer", "pyarrow",
                   "pytest")  # fmt: skip


def machine_site(farm: Path, roots: tuple[str, ...], carried: set[str]) -> set[str]:
    """Links into `farm` the files of `roots` and of everything they require, as this virtualenv has them, less the
    `carried` distributions (here typer requires pydantic; the GPU machine's older typer does not). Returns names."""
    farm.mkdir()
    linked, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in linked or name in carried:
            continue
        linked.add(name)
        dist = metadata.distribution(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (farm / top).exists():
                (farm / top).symlink_to(source)
    return linked


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpu") / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(
        [str(ROOT / "scripts" / "gpu-wheels.sh"), "--python-version", version, str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
    return folder


@pytest.fixture(scope="module")
def gpu_like_python(wheels, tmp_path_factory) -> Path:
    """A fresh virtualenv whose site sees only the GPU machine's packages (linked from this one)."""
    root = tmp_path_factory.mktemp("venv")
    carried = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels.glob("*.whl")}
    linked = machine_site(root / "machine", GPU_MACHINE_HAS, carried)
    assert not linked & carried
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=300)
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (Path(purelib) / "gpu_machine.pth").write_text(f"{root / 'machine'}\n")
    return python


def run_check(python: Path, wheels: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PYTHON": str(python), "GPU_WHEELS": str(wheels), "GPU_SITE": str(tmp_path / "site"),
            "OUT": str(tmp_path / "out"), "PATH": f"{python.parent}:{env['PATH']}"}  # fmt: skip
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--install-only"],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip


def test_the_learner_installs_and_runs_from_the_wheels_alone(gpu_like_python, wheels, tmp_path):
    python = gpu_like_python
    for module in ("pydantic", "deepspeed", "msgpack", "grpc", "rlep"):  # absent before the install: an honest test
        absent = subprocess.run([python, "-c", f"import {module}"], capture_output=True, cwd=tmp_path)
        assert absent.returncode != 0, f"{module} is importable before the install"

    done = run_check(python, wheels, tmp_path)
    versions = (tmp_path / "out" / "versions.txt").read_text()
    assert done.returncode == 0, versions + done.stdout[-3000:] + done.stderr[-3000:]
    assert "imports: 7/7 ok; service modules: none" in versions
    site = str(tmp_path / "site")
    for name in ("deepspeed", "pydantic", "msgpack", "grpcio", "rlep"):  # each imported from the installed wheels
        assert re.search(rf"^{name} +\S+ +{re.escape(site)}", versions, re.MULTILINE), (name, versions)
    assert re.search(r"^install +ok +exit +0", (tmp_path / "out" / "summary.txt").read_text(), re.MULTILINE)

    # DeepSpeed JIT-builds its CPU shm op for this site's copy in a folder of the test's own: built into the shared
    # cache, it replaced the suite's build (the paths differ), and the next learner started built it again (~55 s).
    own = {"PYTHONPATH": site, "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | own
    collected = subprocess.run(
        [python, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o",
         "addopts=-ra --strict-markers"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert collected.returncode == 0 and "skipped" in collected.stdout, collected.stdout[-3000:]
    report = tmp_path / "paths.json"
    probe = subprocess.run(
        [python, "tests/gpu/paths_probe.py", "--cpu", "--cases", "lora,untied_head", "--out", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-4000:]
    assert '"failed": []' in report.read_text()
