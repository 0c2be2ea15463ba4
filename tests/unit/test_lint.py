"""The tree passes ruff's lint and format checks (config in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def ruff() -> str:
    found = Path(sys.executable).with_name("ruff")
    return str(found) if found.exists() else (shutil.which("ruff") or pytest.fail("ruff is not installed"))


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    result = subprocess.run([ruff(), *args], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
