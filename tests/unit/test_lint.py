"""The project's own files pass ruff's lint and format checks (config in pyproject.toml).

"Own files" are what git tracks plus new files git does not ignore, so output that a run writes into
the checkout (`rlep-demo/`, DeepSpeed's generated `zero_to_fp32.py`, checkpoints) is never linted.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def ruff() -> str:
    found = Path(sys.executable).with_name("ruff")
    return str(found) if found.exists() else (shutil.which("ruff") or pytest.fail("ruff is not installed"))


def project_python_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py", "*.pyi"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [path for path in listed if (REPO / path).exists()]  # deleted but not yet staged


def test_project_files_exclude_run_output():
    files = project_python_files()
    assert "services/cli/app.py" in files and "tests/unit/test_lint.py" in files
    assert not [f for f in files if f.startswith(("rlep-demo/", "checkpoints/", "runs/"))]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff(args):
    result = subprocess.run(
        [ruff(), *args, "--force-exclude", *project_python_files()], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
