"""The wheel built from the repository is the whole product: every module, config, proto and dataset is in
it, and it works from a folder that is not a checkout (no `../proto`, no `../configs` to fall back on).

The wheel is built from a copy of the files git tracks or would track (the checkout is left as it is) and
unpacked; a subprocess started outside the checkout imports `rlep` from there, ahead of the editable install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.unit.test_architecture import ROOT, source_modules


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    listing = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(listing, cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not part of it
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name, follow_symlinks=False)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source), "-w", str(out)],
        check=True,
        capture_output=True,
    )
    [built] = out.glob("rlep-*.whl")
    return built


@pytest.fixture(scope="module")
def unpacked(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    zipfile.ZipFile(wheel).extractall(target)
    return target


def test_every_module_and_data_file_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {m.replace(".", "/") for m in source_modules()}
    missing = sorted(m for m in modules if f"{m}.py" not in names and f"{m}/__init__.py" not in names)
    assert missing == []
    data = {
        "rlep/configs/recipes/rlep.yaml",
        "rlep/configs/demo.yaml",
        "rlep/configs/verifier.yaml",
        "rlep/common/v1/trajectory.proto",
        "rlep/replay/v1/replay.proto",
        "rlep/services/eval/datasets/math500.jsonl",
    }
    assert data <= names
    configs = {p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    assert {f"rlep/configs/{c}" for c in configs} <= names
    assert not any(n.startswith(("services/", "rlep_common/", "tests/")) for n in names), "only the rlep namespace"


def test_the_unpacked_wheel_works_outside_the_checkout(unpacked, tmp_path):
    script = """
import importlib.resources, json
import rlep.common.config as config, rlep.services.cli.protogen as protogen, rlep.services.replay.client
print(json.dumps({
    "datasets": sorted(p.name for p in importlib.resources.files("rlep.services.eval.datasets").iterdir()),
    "replay_client": rlep.services.replay.client.__file__,
    "config_dir": str(config.CONFIG_DIR),
    "protos": sorted(protogen.proto_files()),
    "stale": protogen.stale_stubs(),
}))
"""
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["replay_client"].startswith(str(unpacked))
    assert Path(found["config_dir"]) == unpacked / "rlep" / "configs"
    assert len(found["protos"]) == 5 and found["stale"] == []  # common, replay, rollout, sandbox, verifier
    assert {"aime24.jsonl", "math500.jsonl", "gsm8k.jsonl"} <= set(found["datasets"])


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["--help"], "serve"), (["serve", "verifier", "--dry-run"], '"num_workers"'), (["proto", "check"], "match")],
    ids=["help", "dry-run", "proto-check"],
)
def test_the_cli_of_the_unpacked_wheel(unpacked, tmp_path, args, expected):
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    command = [sys.executable, "-c", "from rlep.services.cli.app import app; app()", *args]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert expected in run.stdout
