"""`rlep doctor` as a user runs it, CPU variant: the real command in a process of its own, on the tiny model.

One run of every check (the vLLM engine starts once, ~20-90 s), then its JSON and its output are read: each
check passed and measured what it claims. A second, short run on a folder that is not a model must fail the
learner check with one line naming it, and no traceback.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.service_process import rlep_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Cold caches on a loaded 2-core box: DeepSpeed's shm op build (~3 min once), vLLM's start and sampler compile.
DOCTOR_TIMEOUT_S = 1200


def run_doctor(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*rlep_command(), "doctor", *args], cwd=cwd, capture_output=True, text=True, timeout=DOCTOR_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def doctor_run(tmp_path_factory):
    """(process, JSON report, checks by name) of one full `rlep doctor --json` run."""
    folder = tmp_path_factory.mktemp("doctor")
    process = run_doctor("--json", str(folder / "report.json"), cwd=folder)
    report = json.loads((folder / "report.json").read_text())
    return process, report, {check["name"]: check for check in report["checks"]}


def test_every_check_passes_and_the_command_says_so(doctor_run):
    process, report, checks = doctor_run
    assert process.returncode == 0, process.stdout + process.stderr
    assert list(checks) == ["versions", "learner", "rollout", "broadcast"]
    assert all(c["status"] == "pass" and c["seconds"] > 0 for c in checks.values()), checks
    assert report["gpus"] == [] and "/models/qwen2-" in report["model"]  # the tiny model, CPU variants
    assert process.stdout.strip().splitlines()[-1] == "doctor: all 4 checks passed"
    for title in ("versions", "learner update", "rollout engine", "weight broadcast"):
        assert title in process.stdout
    assert "Traceback" not in process.stdout + process.stderr


def test_versions_reports_what_is_installed(doctor_run):
    _, _, checks = doctor_run
    versions = checks["versions"]
    assert {"torch", "deepspeed", "vllm", "ray", "transformers"} <= versions["values"].keys()
    assert "cuda cpu" in versions["detail"] and f"deepspeed {versions['values']['deepspeed']}" in versions["detail"]


def test_the_learner_update_moves_every_tensor_with_finite_statistics(doctor_run):
    _, _, checks = doctor_run
    values = checks["learner"]["values"]
    assert values["tensors"] > 0 and values["tensors_moved"] == values["tensors"]
    for key in ("loss", "entropy", "approx_kl", "clip_fraction"):
        assert math.isfinite(values[key]), key
    # Adam's first step moves each weight by about its lr (1e-3): the update really ran.
    assert 5e-4 < values["max_weight_change"] < 2e-3
    assert checks["learner"]["detail"].startswith("cpu:")


def test_after_the_push_the_replica_serves_the_learners_weights(doctor_run):
    _, _, checks = doctor_run
    values = checks["rollout"]["values"]
    tolerance = values["tolerance"]
    assert values["versions"] == [1] and values["tokens"] > 0
    assert values["max_diff_loaded"] < tolerance  # the checkpoint as served agrees with transformers
    assert values["max_diff_before"] > tolerance  # the pushed weights are far enough away to be seen
    assert values["max_diff_after"] < tolerance  # and after the push the replica serves them
    assert f"after push {values['max_diff_after']:.2g} < {tolerance:g}" in checks["rollout"]["detail"]


def test_the_gloo_broadcast_delivers_every_tensor_unchanged(doctor_run):
    _, _, checks = doctor_run
    values = checks["broadcast"]["values"]
    assert values["backend"] == "gloo" and values["tensors"] > 0 and values["bytes"] > 0
    assert values["digest"] == values["receiver_digest"]
    assert checks["broadcast"]["detail"].startswith("gloo, two CPU processes:")


def test_a_folder_that_is_not_a_model_fails_the_learner_check_in_one_line(tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "README").write_text("weights went elsewhere\n")
    report = tmp_path / "report.json"
    process = run_doctor(
        "--model", str(not_a_model), "--skip", "rollout", "--skip", "broadcast", "--json", str(report), cwd=tmp_path
    )
    assert process.returncode == 1
    last = process.stderr.strip().splitlines()[-1]
    assert last.startswith("doctor: FAILED learner: CPU: ") and str(not_a_model) in last, last
    assert "Traceback" not in process.stdout + process.stderr
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    assert [checks[n]["status"] for n in ("versions", "learner", "rollout", "broadcast")] == [
        "pass",
        "fail",
        "skip",
        "skip",
    ]
    # The worker's whole log is kept for the user, traceback included (removed here: the test made it).
    log = Path(checks["learner"]["log_file"])
    assert "Traceback (most recent call last)" in log.read_text() and log.parent.parent.name.startswith("rlep-doctor-")
    shutil.rmtree(log.parent.parent)
