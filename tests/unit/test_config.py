"""Configs: every YAML file in the repo parses, layering precedence, strictness."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlep_common.cli import SERVICES, _load
from rlep_common.config import CONFIG_DIR, ServerConfig, StrictModel, load_config, parse_override
from services.verifier.config import VerifierConfig

REPO = Path(__file__).resolve().parents[2]


# Config files of jobs rather than services: file stem -> config class.
JOB_CONFIGS = {"train": "services.learner.config:TrainConfig"}


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
    for model in (ServerConfig, VerifierConfig):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"


def test_parse_override():
    assert parse_override("server.port=50061") == ("server.port", 50061)
    assert parse_override("reward_wrong=-1.0") == ("reward_wrong", -1.0)
    with pytest.raises(ValueError, match="key.path=value"):
        parse_override("novalue")
