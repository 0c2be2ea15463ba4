"""Configs: every YAML file in the repo parses, layering precedence, strictness."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlep.common.config import (
    CONFIG_DIR,
    ServerConfig,
    StrictModel,
    TlsFiles,
    load_config,
    parse_override,
    redact_secrets,
)
from rlep.services.cli.app import SERVICES, _load
from rlep.services.verifier.config import VerifierConfig

REPO = Path(__file__).resolve().parents[2]


# Config files of jobs rather than services: file stem -> config class.
JOB_CONFIGS = {
    "train": "rlep.services.learner.config:TrainConfig",
    "demo": "rlep.services.demo.runner:DemoConfig",
    "demo-tools": "rlep.services.demo.tool_runner:ToolDemoConfig",
}


def test_every_config_file_parses():
    files = sorted(CONFIG_DIR.glob("*.yaml"))
    assert files, "configs/ holds no YAML"
    for path in files:
        kind = path.stem
        assert kind in SERVICES or kind in JOB_CONFIGS, f"{path.name} names no service or job"
        config_class = SERVICES[kind].config_class if kind in SERVICES else JOB_CONFIGS[kind]
        config = load_config(_load(config_class), path)
        assert isinstance(config, StrictModel)


def test_precedence_defaults_file_env_cli(tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text("num_workers: 3\nitem_timeout_s: 9\nserver:\n  port: 1111\n")
    environ = {"RLEP_VERIFIER__SERVER__PORT": "2222", "RLEP_VERIFIER__ITEM_TIMEOUT_S": "8", "RLEP_OTHER__X": "1"}
    config = load_config(VerifierConfig, path, {"item_timeout_s": 7}, env_prefix="verifier", environ=environ)
    assert config.num_workers == 3  # file
    assert config.server.port == 2222  # env beats file
    assert config.item_timeout_s == 7  # command line beats env
    assert config.server.host == "127.0.0.1"  # default: loopback


def test_precedence_of_base_file_env_sets_and_flags(tmp_path):
    """base < file < env < --set < flags; a flag of None is not given, so the layers below decide."""
    base, path = tmp_path / "base.yaml", tmp_path / "v.yaml"
    base.write_text("num_workers: 5\nmax_answer_chars: 9\nreward_correct: 2\nreward_wrong: -0.5\n")
    path.write_text("num_workers: 3\n")
    environ = {"RLEP_VERIFIER__MAX_ANSWER_CHARS": "8", "RLEP_VERIFIER__REWARD_CORRECT": "3"}
    config = load_config(
        VerifierConfig,
        path,
        {"reward_correct": 4, "reward_wrong": None},
        env_prefix="verifier",
        sets=["max_answer_chars=7", "reward_correct=1"],
        base=base,
        environ=environ,
    )
    assert config.reward_wrong == -0.5  # base (the flag is None: not given)
    assert config.num_workers == 3  # file beats base
    assert config.max_answer_chars == 7  # --set beats env
    assert config.reward_correct == 4  # flag beats --set
    with pytest.raises(ValueError, match="key.path=value"):
        load_config(VerifierConfig, sets=["novalue"])


def test_a_mapping_is_the_file_layer_and_is_left_unchanged():
    """Ray Serve passes the config section of its YAML already parsed: it gets the env layer like a file."""
    given = {"server": {"host": "0.0.0.0"}}
    environ = {"RLEP_REPLAY__SERVER__GRPC_THREADS": "4"}
    from rlep.services.replay.config import ReplayConfig

    config = load_config(ReplayConfig, given, env_prefix="replay", environ=environ)
    assert (config.server.host, config.server.grpc_threads, config.server.port) == ("0.0.0.0", 4, 50062)
    assert given == {"server": {"host": "0.0.0.0"}}


def test_unknown_keys_and_bad_values_are_rejected(tmp_path):
    with pytest.raises(ValidationError, match="extra"):
        VerifierConfig.model_validate({"num_wokers": 2})
    with pytest.raises(ValidationError, match="greater than or equal"):
        VerifierConfig.model_validate({"num_workers": 0})
    with pytest.raises(ValidationError, match="item_timeout_s"):
        VerifierConfig.model_validate({"item_timeout_s": 2, "parse_timeout_s": 1})
    with pytest.raises(ValidationError, match="does not exist"):
        ServerConfig(auth_token_file=tmp_path / "missing")


def test_fields_are_documented():
    for model in (ServerConfig, TlsFiles, VerifierConfig):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"


def test_parse_override():
    assert parse_override("server.port=50061") == ("server.port", 50061)
    assert parse_override("reward_wrong=-1.0") == ("reward_wrong", -1.0)
    with pytest.raises(ValueError, match="key.path=value"):
        parse_override("novalue")


def test_a_partial_section_keeps_the_sections_defaults(tmp_path):
    """Replay's `server` defaults to port 50062: setting only its host, from any layer, must not reset the port."""
    from rlep.services.eval.config import EvalConfig
    from rlep.services.replay.config import ReplayConfig

    path = tmp_path / "r.yaml"
    path.write_text("server:\n  host: 0.0.0.0\n")
    from_file = load_config(ReplayConfig, path)
    from_env = load_config(ReplayConfig, environ={"RLEP_REPLAY__SERVER__METRICS_PORT": "9"}, env_prefix="replay")
    from_flag = load_config(ReplayConfig, overrides={"server.grpc_threads": 4})
    assert (from_file.server.host, from_file.server.port) == ("0.0.0.0", 50062)
    assert (from_env.server.metrics_port, from_env.server.port) == (9, 50062)
    assert (from_flag.server.grpc_threads, from_flag.server.port) == (4, 50062)
    # A default instance with a required field: setting a sibling alone used to fail ("addresses ... required").
    eval_config = load_config(EvalConfig, overrides={"rollout.timeout_s": 5})
    assert (eval_config.rollout.timeout_s, eval_config.rollout.names()) == (5, ["127.0.0.1:50063"])


def test_a_section_naming_another_variant_is_not_mixed_with_the_default():
    from typing import Literal

    class A(StrictModel):
        type: Literal["a"] = "a"
        only_a: int = 0

    class B(StrictModel):
        type: Literal["b"] = "b"
        only_b: int = 0

    class Root(StrictModel):
        choice: A | B = A(only_a=3)

    assert load_config(Root, overrides={"choice.type": "b"}).choice == B()
    assert load_config(Root, overrides={"choice.type": "a"}).choice == A(only_a=3)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:pw@h:6379/0", "redis://user:***@h:6379/0"),
        ("rediss://u:p%40ss@[::1]:6380", "rediss://u:***@[::1]:6380"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://user@h/0", "redis://user@h/0"),
        ("redis://h/0?password=pw&db=1", "redis://h/0?password=***&db=1"),
        ("not a url @ all", "not a url @ all"),
    ],
)
def test_redact_secrets_masks_url_passwords_only(value, shown):
    assert redact_secrets({"a": [{"url": value}], "n": 3}) == {"a": [{"url": shown}], "n": 3}


def test_mini_batches_count_fresh_rows_by_default_and_all_rows_for_the_equal_updates_control():
    """B=16, G=8, M=2, 4 questions per mini-batch: verl's reading gives RLEP 5 updates per step against the
    baseline's 4 (160 / 32); counting all rows gives it the baseline's 4 (160 / 40)."""
    from rlep.services.learner.config import AlgorithmConfig

    sizes = {"questions_per_step": 16, "fresh_per_question": 8, "replayed_per_question": 2, "mini_batch_questions": 4}
    assert AlgorithmConfig(**sizes).mini_batch_size == 32
    assert AlgorithmConfig(**sizes, mini_batch_rows="all").mini_batch_size == 40
    assert AlgorithmConfig(**{**sizes, "replayed_per_question": 0}, mini_batch_rows="all").mini_batch_size == 32


def test_tools_take_replay_and_survive_the_actors_dump():
    from rlep.services.learner.config import TrainConfig

    config = TrainConfig.model_validate({"tools": {"replay": {"max_token_fraction": 0.5, "max_staleness": 2}}})
    assert config.algorithm.replayed_per_question == 2 and config.tools.void_turns == "filter"
    with pytest.raises(ValueError, match="max_token_fraction"):
        TrainConfig.model_validate({"tools": {"replay": {"max_token_fraction": 0}}})
    # What the learner's actors receive: the config dumped and read again.
    assert TrainConfig.model_validate(config.model_dump(mode="json")) == config


@pytest.mark.parametrize("service", ["verifier", "sandbox"])
def test_unary_call_slots_leave_the_health_check_a_thread(service):
    """The verifier's and the sandbox's `max_calls_in_flight` share one bound (`ServerConfig.call_slots`)."""
    from rlep.common.config import ServerConfig
    from rlep.services.sandbox.config import SandboxServiceConfig
    from rlep.services.verifier.config import VerifierConfig

    config_class = VerifierConfig if service == "verifier" else SandboxServiceConfig
    server = ServerConfig(grpc_threads=6)
    assert (
        config_class(server=server).call_slots == 4
        and config_class(server=server, max_calls_in_flight=5).call_slots == 5
    )
    with pytest.raises(ValueError, match=r"max_calls_in_flight \(6\) must stay below server.grpc_threads \(6\)"):
        config_class(server=server, max_calls_in_flight=6)
