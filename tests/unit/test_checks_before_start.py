"""Issue 47 item 3: what `rlep train` can check before Ray and the services start, it checks at once; a Ctrl-C
prints the command that resumes. (A real run's checkpoint and `--resume` of it: test_learner_loop.py.)

The stack never starts here: `run_training` is replaced by a function that fails the test or raises what a
running one would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
from typer.testing import CliRunner

from rlep.services.cli.app import app
from rlep.services.learner.checkpoint_info import INFO_FILE, write_checkpoint_info
from rlep.services.learner.config import TrainConfig
from tests.unit.test_refused_settings import DATA, refused

runner = CliRunner()


@pytest.fixture
def stack_start(monkeypatch):
    """Replaces `run_training`; the test sets `raises` to what the run does (default: fail the test)."""
    fake = types.ModuleType("rlep.services.launch.training")
    fake.raises = AssertionError("the command went on to start Ray and the services")

    def run_training(*args, **kwargs):
        raise fake.raises

    fake.run_training = run_training
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    return fake


def checkpoint(tmp_path, step: int, **lora) -> None:
    """A checkpoint directory as the trainer leaves it: `latest` naming step_N, which says what it trained."""
    config = TrainConfig.model_validate({"checkpoint": {"dir": str(tmp_path)}, "lora": lora})
    write_checkpoint_info(tmp_path / f"step_{step}", config, step)
    (tmp_path / "latest").write_text(f"step_{step}")


def train(tmp_path, *sets: str) -> list[str]:
    args = ["train", "--data", str(DATA), "--resume", "--set", f"checkpoint.dir={tmp_path}", "--set", "steps=10"]
    return args + [arg for s in sets for arg in ("--set", s)]


def test_resume_with_another_lora_shape_is_refused_in_one_line_naming_the_settings_that_fit(tmp_path, stack_start):
    """Before: 162 s of start-up, then a 504-line traceback from DeepSpeed's load."""
    checkpoint(tmp_path, 4, rank=8, target_modules=["q_proj", "v_proj"])
    text = refused(train(tmp_path, "lora.rank=16", "lora.target_modules=[q_proj,v_proj]"), "LoRA rank 8 on q_proj")
    assert "LoRA rank 16" in text and "--set lora.rank=8 --set 'lora.target_modules=[q_proj, v_proj]'" in text
    refused(train(tmp_path, "lora.rank=8", "lora.target_modules=[q_proj]"), "LoRA rank 8 on q_proj, v_proj")
    refused(train(tmp_path), "full fine-tuning (lora.rank=0)", "another checkpoint.dir")


def test_resume_of_full_fine_tuning_with_lora_is_refused_and_the_same_shape_goes_on(tmp_path, stack_start):
    checkpoint(tmp_path, 4)
    refused(train(tmp_path, "lora.rank=8"), "was trained with full fine-tuning", "--set lora.rank=0")
    result = runner.invoke(app, train(tmp_path))
    assert isinstance(result.exception, AssertionError) and "start Ray" in str(result.exception)


def test_a_checkpoint_from_before_the_info_file_is_checked_by_its_step_only(tmp_path, stack_start):
    (tmp_path / "latest").write_text("step_3")
    result = runner.invoke(app, train(tmp_path, "lora.rank=8"))
    assert isinstance(result.exception, AssertionError) and "start Ray" in str(result.exception)


def test_resume_of_a_finished_run_says_so_and_starts_nothing(tmp_path, stack_start):
    """Before: the whole stack started (157 s) to train no step."""
    checkpoint(tmp_path, 10)
    result = runner.invoke(app, train(tmp_path))
    assert result.exit_code == 0, result.output
    assert "at step 10 and this run trains 10 steps: nothing to do" in result.output


def test_an_unreadable_checkpoint_is_named(tmp_path, stack_start):
    (tmp_path / "latest").write_text("global_step7")
    refused(train(tmp_path), "names 'global_step7', not a step_N checkpoint")
    checkpoint(tmp_path, 2)
    (tmp_path / "step_2" / INFO_FILE).write_text("{")
    refused(train(tmp_path), INFO_FILE, "not an RLEP checkpoint info file")


def test_ctrl_c_prints_the_command_that_resumes(tmp_path, stack_start, monkeypatch):
    stack_start.raises = KeyboardInterrupt()
    checkpoint(tmp_path, 6)
    args = ["train", "--data", str(DATA), "--set", f"checkpoint.dir={tmp_path}"]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/rlep", *args])  # as the console script sees it
    result = runner.invoke(app, args)
    assert result.exit_code == 130
    last = result.output.strip().splitlines()[-1]
    assert last == f"interrupted; {tmp_path} holds step 6. To continue from it: rlep {' '.join(args)} --resume"


def test_ctrl_c_before_any_checkpoint_says_a_rerun_starts_over(tmp_path, stack_start):
    stack_start.raises = KeyboardInterrupt()
    result = runner.invoke(app, ["train", "--data", str(DATA), "--set", f"checkpoint.dir={tmp_path}"])
    assert result.exit_code == 130
    assert f"no checkpoint was written in {tmp_path} yet, so a rerun starts from step 0" in result.output


def test_ray_that_does_not_start_is_one_line_not_a_traceback(tmp_path):
    """Before: 54 lines of Ray's traceback. A temp dir Ray cannot create fails its start as a loaded host can."""
    env = {**os.environ, "RAY_TMPDIR": "/proc/rlep-no-such-dir"}
    command = [sys.executable, "-m", "rlep.services.cli.app", "train", "--data", str(DATA), "--steps", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: Ray did not start on this machine"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "/proc/rlep-no-such-dir/ray/session_latest/logs" in lines[-1]
