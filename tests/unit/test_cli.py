"""The `rlep` command: instant help, resolved configs, and no heavy imports before parsing."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlep.services.cli.app import SERVICES, app
from rlep.services.launch.serve import SERVE_FOREVER, start_rollout_worker

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


@pytest.mark.parametrize("service", list(SERVICES))
def test_rlep_serve_runs_the_services_own_main(service, monkeypatch):
    """`rlep serve NAME` is served by NAME's `main` (through the launch room), given the resolved config; every
    service's main is a stand-in here, so no server (or vLLM) starts, and the wrong one says which it was."""
    served = []
    for name in SERVICES:
        stand_in = types.ModuleType(f"rlep.services.{name}.main")
        stand_in.serve_forever = lambda config, name=name: served.append((name, config))
        stand_in.start_rollout = lambda config, name=name: (name, config)
        monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    config = object()
    SERVE_FOREVER[service](config)
    assert served == [(service, config)]
    if service == "rollout":
        assert start_rollout_worker(config) == ("rollout", config)  # `rlep doctor`'s replica check


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
    result = runner.invoke(
        app, ["train", "--set", "algorithm.replayed_per_question=0", "--dry-run", "--skip-path-checks"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["algorithm"]["replayed_per_question"] == 0


def test_train_dry_run_masks_the_replay_redis_password():
    url = "redis://:s3cret-pw@redis.example:6379/0"
    result = runner.invoke(app, ["train", "--set", f"local.replay_redis_url={url}", "--dry-run", "--skip-path-checks"])
    assert result.exit_code == 0, result.output
    assert "s3cret-pw" not in result.output
    assert json.loads(result.output)["local"]["replay_redis_url"] == "redis://:***@redis.example:6379/0"


def test_demo_reads_a_file_over_its_defaults_then_env_and_flags(tmp_path):
    """configs/demo.yaml < --config < RLEP_DEMO__* < --set < --seed/--out-dir."""
    path = tmp_path / "demo.yaml"
    path.write_text("steps: 20\neval_every: 4\ntrain:\n  optim:\n    warmup_steps: 3\n")
    env = {"RLEP_DEMO__EVAL_EVERY": "2", "RLEP_DEMO__SEED": "9"}
    result = runner.invoke(app, ["demo", "--config", str(path), "--seed", "4", "--dry-run"], env=env)
    assert result.exit_code == 0, result.output
    config = json.loads(result.output)
    assert (config["steps"], config["eval_every"], config["seed"]) == (20, 2, 4)
    assert config["lr"] == 1e-4 and config["out_dir"] == "rlep-demo"  # from configs/demo.yaml
    # The shared training section merges too: the file's warm-up beside the defaults' other optim settings.
    assert config["train"]["optim"] == {"warmup_steps": 3, "weight_decay": 0.0, "micro_batch_size": 64}


def test_eval_options_left_out_take_the_request_defaults(monkeypatch):
    """`rlep eval` writes no sampling default of its own: what is not given is EvaluationRequest's."""
    from rlep.services.cli import eval as eval_cli
    from rlep.services.eval.api import DatasetRequest, EvaluationRequest

    sent = []
    monkeypatch.setattr(eval_cli, "run_eval", lambda server, token, request, **options: sent.append(request))
    base = ["eval", "--model", "current", "--datasets", "amc23"]
    assert runner.invoke(app, base).exit_code == 0
    assert runner.invoke(app, [*base, "--n", "4", "--temperature", "1.0", "--seed", "7"]).exit_code == 0
    datasets = [DatasetRequest(name="amc23")]
    assert sent[0] == EvaluationRequest(model="current", datasets=datasets)
    assert sent[1] == EvaluationRequest(model="current", datasets=datasets, n=4, temperature=1.0, seed=7)
    assert (sent[1].top_p, sent[1].max_tokens) == (sent[0].top_p, sent[0].max_tokens)


def test_collect_flags_left_out_take_the_config_defaults(tmp_path, monkeypatch):
    """`rlep collect` writes no CollectConfig default of its own: an unset flag leaves the config's value."""
    from rlep.services.cli.train import _collect_config
    from rlep.services.learner.config import CollectConfig

    data = tmp_path / "q.parquet"
    data.write_bytes(b"")
    flags = {"data.train_files": [str(data)], "collect.samples_per_question": None, "collect.temperature": 0.5}
    resolved = _collect_config(None, None, flags).collect
    assert resolved == CollectConfig(temperature=0.5)


def test_demo_runs_take_the_shared_settings_and_differ_only_in_m_and_names(tmp_path):
    from rlep.services.demo.runner import demo_train_config, load_demo_config

    demo = load_demo_config(flags={"out_dir": tmp_path})
    paths = (tmp_path / "warmup", tmp_path / "train.parquet", tmp_path / "eval.parquet")
    baseline = demo_train_config(demo, "baseline", 0, *paths).model_dump()
    rlep = demo_train_config(demo, "rlep", demo.replayed_per_question, *paths).model_dump()
    assert baseline["algorithm"]["replayed_per_question"] == 0 and rlep["algorithm"]["replayed_per_question"] == 2
    for config in (baseline, rlep):  # configs/demo.yaml's `train` section beside the per-run sizes
        assert config["optim"] == {**config["optim"], "lr": 1e-4, "warmup_steps": 2, "micro_batch_size": 64}
        assert config["algorithm"]["overlong_buffer_tokens"] == 8 and config["algorithm"]["mini_batch_questions"] == 16
        assert config["local"]["rollout_engine"]["dtype"] == "float32" and config["local"]["rollout_cpus"] == 0.5
        # its own Redis beside its files: a demo never collides with (or writes into) the one a user's runs share
        assert config["local"]["replay_redis_dir"] == (tmp_path / "redis").resolve()
        assert (config["steps"], config["eval"]["every_steps"], config["eval"]["temperature"]) == (100, 5, 1.0)
    for key in ("run_id", "checkpoint", "algorithm"):
        del baseline[key], rlep[key]
    assert baseline == rlep


def test_proto_commands_without_grpcio_tools_say_what_to_install(monkeypatch):
    """A plain `pip install rlep` has no grpcio-tools: a message and exit code 2, not a traceback."""
    monkeypatch.setitem(sys.modules, "grpc_tools", None)  # makes `import grpc_tools` fail
    for command in (["proto", "check"], ["proto", "gen"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert "needs grpcio-tools: pip install 'rlep[proto]'" in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


def tiny_training_file(tmp_path: Path) -> Path:
    from rlep.services.demo.task import make_problems, write_parquet

    path = tmp_path / "train.parquet"
    write_parquet(make_problems(4, 0, "train"), path)
    return path


def test_train_flags_reach_the_config_and_dry_run_shows_the_model_the_replicas_serve(tmp_path):
    """Issue 32: `rlep train` had none of collect's flags, and --dry-run showed rollout_engine.model "tiny" with
    `model:` set elsewhere (the stack replaced it at run time)."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    data = tiny_training_file(tmp_path)
    args = ["train", "--model", str(model), "--data", str(data), "--pool", "p1", "--steps", "3", "--dry-run"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert (shown["model"], shown["replay_pool"], shown["steps"]) == (str(model), "p1", 3)
    assert shown["data"]["train_files"] == [str(data)]
    assert shown["local"]["rollout_engine"]["model"] == str(model)


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        (None, "does not exist"),
        ([], "has no config.json"),
        (["config.json"], "has no weights"),
        (["config.json", "model.safetensors"], "has no tokenizer"),
    ],
)
def test_train_dry_run_names_a_model_that_cannot_run(tmp_path, files, problem):
    """Issue 32: `--set model=models/nope --dry-run` exited 0; the real run failed 100 s later without naming it."""
    model = tmp_path / "nope"
    if files is not None:
        model.mkdir()
        for name in files:
            (model / name).write_text("{}")
    result = runner.invoke(
        app, ["train", "--model", str(model), "--data", str(tiny_training_file(tmp_path)), "--dry-run"]
    )
    assert result.exit_code == 2
    assert f"model `{model}` {problem}" in " ".join(result.output.split())


def test_train_dry_run_names_missing_data_in_one_line(tmp_path):
    result = runner.invoke(app, ["train", "--dry-run"])
    assert result.exit_code == 2 and "error: no training data given; pass --data FILE" in result.output
    missing = tmp_path / "gone.parquet"
    result = runner.invoke(app, ["train", "--data", str(missing), "--dry-run"])
    assert result.exit_code == 2 and f"training file {missing} does not exist" in " ".join(result.output.split())
