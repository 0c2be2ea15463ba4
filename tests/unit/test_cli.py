"""The `rlep` command: instant help, resolved configs, and no heavy imports before parsing."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rlep_common.cli import app

runner = CliRunner()


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys\nfrom rlep_common.cli import app\n"
        "try:\n    app(['serve', 'verifier', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = ('torch', 'grpc', 'math_verify', 'redis', 'vllm', 'deepspeed', 'ray')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out and "--auth-token-file" in out


def test_dry_run_prints_resolved_config(tmp_path):
    token = tmp_path / "token"
    token.write_text("t")
    result = runner.invoke(
        app,
        ["serve", "verifier", "--port", "6000", "--auth-token-file", str(token), "--set", "num_workers=3", "--dry-run"],
    )
    assert result.exit_code == 0, result.output
    config = json.loads(result.output)
    assert config["server"]["port"] == 6000 and config["num_workers"] == 3
    assert config["server"]["auth_token_file"] == str(token)


@pytest.mark.parametrize("args", [["--set", "num_workers=0"], ["--set", "bogus=1"], ["--port", "70000"]])
def test_bad_settings_are_usage_errors(args):
    result = runner.invoke(app, ["serve", "verifier", *args, "--dry-run"])
    assert result.exit_code == 2


def test_demo_resolves_its_settings():
    result = runner.invoke(app, ["demo", "--seed", "4", "--set", "steps=12", "--dry-run"])
    assert result.exit_code == 0, result.output
    config = json.loads(result.output)
    assert config["seed"] == 4 and config["steps"] == 12 and config["replayed_per_question"] == 2


@pytest.mark.parametrize("args", [["--set", "steps=0"], ["--set", "nope=1"]])
def test_demo_refuses_bad_settings(args):
    assert runner.invoke(app, ["demo", *args, "--dry-run"]).exit_code == 2


def test_train_dry_run_reads_overrides():
    result = runner.invoke(app, ["train", "--set", "algorithm.replayed_per_question=0", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["algorithm"]["replayed_per_question"] == 0
