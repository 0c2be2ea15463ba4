"""The `rlep` command: instant help, resolved configs, and no heavy imports before parsing."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rlep.services.cli.app import app

runner = CliRunner()


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys\nfrom rlep.services.cli.app import app\n"
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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "num_workers=0"], "greater than or equal to 1"),
        (["--set", "bogus=1"], "bogus"),
        (["--port", "70000"], "less than or equal to 65535"),
    ],
)
def test_bad_settings_are_usage_errors(args, message):
    result = runner.invoke(app, ["serve", "verifier", *args, "--dry-run"])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())  # rich wraps lines in a box


# Defaults a flag must leave alone: each service's own port, loopback, no token, its metrics port (None).
SERVICE_DEFAULTS = {
    "verifier": {"host": "127.0.0.1", "port": 50061, "auth_token_file": None, "metrics_port": None},
    "replay": {"host": "127.0.0.1", "port": 50062, "auth_token_file": None, "metrics_port": None},
    "rollout": {"host": "127.0.0.1", "port": 50063, "auth_token_file": None, "metrics_port": None},
    "eval": {"host": "127.0.0.1", "port": 8080, "auth_token_file": None},
}
FLAGS = {"--host": ("host", "0.0.0.0"), "--port": ("port", 6001), "--metrics-port": ("metrics_port", 9999)}


@pytest.mark.parametrize("service", sorted(SERVICE_DEFAULTS))
@pytest.mark.parametrize("flag", [*FLAGS, "--auth-token-file"])
def test_each_flag_changes_only_itself(service, flag, tmp_path):
    """A flag used alone sets its own field; every other server field keeps the service's default."""
    if flag == "--auth-token-file":
        (tmp_path / "token").write_text("t")
        field, value = "auth_token_file", str(tmp_path / "token")
    else:
        field, value = FLAGS[flag]
    expected = dict(SERVICE_DEFAULTS[service])
    if field not in expected:
        result = runner.invoke(app, ["serve", service, flag, str(value), "--dry-run"])
        assert result.exit_code == 2
        assert f"{flag} does not apply to {service}" in " ".join(result.output.split())
        return
    result = runner.invoke(app, ["serve", service, flag, str(value), "--dry-run"])
    assert result.exit_code == 0, result.output
    expected[field] = value
    server = json.loads(result.output)["server"]
    assert {key: server[key] for key in expected} == expected


def test_dry_run_masks_url_passwords():
    url = "redis://svc:s3cret-pw@redis.example:6379/0"
    result = runner.invoke(app, ["serve", "replay", "--set", f"redis_url={url}", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "s3cret-pw" not in result.output
    assert json.loads(result.output)["redis_url"] == "redis://svc:***@redis.example:6379/0"


def test_demo_resolves_its_settings():
    result = runner.invoke(app, ["demo", "--seed", "4", "--set", "steps=12", "--dry-run"])
    assert result.exit_code == 0, result.output
    config = json.loads(result.output)
    assert config["seed"] == 4 and config["steps"] == 12 and config["replayed_per_question"] == 2


@pytest.mark.parametrize(("args", "message"), [(["--set", "steps=0"], "steps"), (["--set", "nope=1"], "nope")])
def test_demo_refuses_bad_settings(args, message):
    result = runner.invoke(app, ["demo", *args, "--dry-run"])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_train_dry_run_reads_overrides():
    result = runner.invoke(app, ["train", "--set", "algorithm.replayed_per_question=0", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["algorithm"]["replayed_per_question"] == 0


def test_train_dry_run_masks_the_replay_redis_password():
    url = "redis://:s3cret-pw@redis.example:6379/0"
    result = runner.invoke(app, ["train", "--set", f"local.replay_redis_url={url}", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "s3cret-pw" not in result.output
    assert json.loads(result.output)["local"]["replay_redis_url"] == "redis://:***@redis.example:6379/0"
