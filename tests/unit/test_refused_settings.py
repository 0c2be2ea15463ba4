"""Settings that used to do nothing, or something else than asked, without a word (issue 47, item 2): each is now
refused in one line naming the flag or key and the fix, before Ray or any service starts.

The commands run in this process; the module that would start the stack is replaced by one that fails the test,
so a refusal that breaks cannot start Ray here.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from rlep.common.ports import free_port
from rlep.services.cli.app import app
from rlep.services.learner.config import CollectConfig, LoraConfig, TrainConfig

runner = CliRunner()
DATA = Path(__file__).parents[1] / "data" / "dapo_math_17k.parquet"  # a real verl parquet


def refused(args: list[str], *needles: str) -> str:
    """Runs `rlep args`; asserts exit code 2 and one line `error: ...` holding every needle, without a traceback."""
    result = runner.invoke(app, args)
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert text.startswith("error:") and len(text.splitlines()) == 1, text
    for needle in needles:
        assert needle in text, text
    return text


@pytest.fixture
def nothing_starts(monkeypatch):
    """`rlep train` and `rlep collect` fail the test if they get as far as starting the stack."""

    def started(*args, **kwargs):
        raise AssertionError("the command went on to start Ray and the services")

    for module, function in (("training", "run_training"), ("collection", "collect_pool")):
        fake = types.ModuleType(f"rlep.services.launch.{module}")
        setattr(fake, function, started)
        monkeypatch.setitem(sys.modules, fake.__name__, fake)


# -- lora.rank 0 with LoRA settings ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"alpha": 32.0}, "lora.alpha"),
        ({"target_modules": ["q_proj"]}, "lora.target_modules"),
        ({"dropout": 0.1}, "lora.dropout"),
    ],
)
def test_lora_settings_without_a_rank_are_refused(settings, named):
    """Before: rank 0 with alpha, targets or dropout set trained every weight of the model, LoRA silently off."""
    with pytest.raises(ValidationError, match=f"lora.rank is 0.*{named}.*set lora.rank"):
        TrainConfig.model_validate({"lora": {"rank": 0, **settings}})


def test_lora_defaults_and_a_full_dump_still_load():
    """The learner's Ray actors get the config as a full dump (every field given): rank 0 with the default LoRA
    settings is full fine-tuning, not a mistake."""
    TrainConfig.model_validate(TrainConfig().model_dump(mode="json"))
    assert LoraConfig(rank=8, alpha=32.0, dropout=0.1).enabled


def test_train_names_the_lora_key_in_one_line(nothing_starts):
    refused(["train", "--data", str(DATA), "--set", "lora.alpha=32"], "lora.rank is 0", "lora.alpha")


# -- a LoRA target that names no module (checked against the model's structure before anything starts) -------------
def test_train_refuses_a_lora_target_the_model_does_not_have(nothing_starts):
    """Before: PEFT adapted the names that matched and dropped `qproj` without a word."""
    args = ["train", "--data", str(DATA), "--set", "lora.rank=4", "--set", "lora.target_modules=[q_proj,qproj]"]
    text = refused(args, "lora.target_modules: qproj matches no module", "q_proj, k_proj")
    assert "q_proj matches" not in text


def test_train_dry_run_refuses_it_too(nothing_starts):
    refused(["train", "--data", str(DATA), "--dry-run", "--set", "lora.rank=4", "--set", "lora.target_modules=[x]"])


# -- --resume without a checkpoint -------------------------------------------------------------------------------
def test_resume_without_a_checkpoint_is_refused_before_anything_starts(tmp_path, nothing_starts):
    """Before: Ray, the services and the model came up first; then the trainer raised FileNotFoundError, traceback."""
    args = ["train", "--data", str(DATA), "--resume", "--set", f"checkpoint.dir={tmp_path}"]
    refused(args, "--resume: no checkpoint in", str(tmp_path), "drop --resume")
    refused(["train", "--data", str(DATA), "--resume"], "--resume", "checkpoint.dir is not set")


def test_resume_with_a_checkpoint_goes_on(tmp_path, nothing_starts):
    (tmp_path / "latest").write_text("step_2")  # what DeepSpeed writes beside step_N
    result = runner.invoke(app, ["train", "--data", str(DATA), "--resume", "--set", f"checkpoint.dir={tmp_path}"])
    assert isinstance(result.exception, AssertionError) and "start Ray" in str(result.exception)


# -- pool export to a name that is not .parquet ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["out.csv", "out", "out.parquet.tmp"])
def test_pool_export_refuses_a_name_that_is_not_parquet(tmp_path, name):
    """Before: `out.csv` got parquet bytes. Refused before any RPC: no replay service listens here."""
    target = tmp_path / name
    refused(["pool", "export", "p", str(target), "-a", f"127.0.0.1:{free_port()}"], str(target), "name a .parquet file")
    assert not target.exists()


def test_pool_export_to_parquet_goes_on_to_the_service(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    refused(["pool", "export", "p", str(tmp_path / "OUT.Parquet"), "-a", address], f"replay service at {address}")


# -- collect with min_successes > n --------------------------------------------------------------------------------
def test_collect_refuses_more_successes_than_samples(nothing_starts):
    """Before: Ray and vLLM started and sampled every question, and kept none."""
    refused(["collect", "--data", str(DATA), "--n", "1", "--min-successes", "2"], "--min-successes", "--n")
    with pytest.raises(ValidationError, match="lower --min-successes or raise --n"):
        CollectConfig(samples_per_question=3, min_successes=4)
    assert CollectConfig(samples_per_question=2, min_successes=2).min_successes == 2
