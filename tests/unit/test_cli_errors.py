"""Mistakes a user can make with `rlep`: each is one or two lines naming the problem and the fix, no traceback.

Real conditions only: a port nobody listens on, files of the wrong kind, real pydantic errors.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlep.common.ports import free_port
from rlep.services.cli.app import app
from rlep.services.cli.errors import config_error
from rlep.services.learner.config import TrainConfig

runner = CliRunner()


def refused(args: list[str], *needles: str) -> str:
    """Runs `rlep args`; asserts a non-zero exit and a short message holding every needle, without a traceback."""
    result = runner.invoke(app, args)
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    text = result.output.strip()
    assert "Traceback" not in text
    assert text.startswith("error:"), text
    assert len(text.splitlines()) <= 2, text
    for needle in needles:
        assert needle in text, text
    return text


def test_eval_without_an_eval_service_names_it_and_how_to_start_it():
    server = f"http://127.0.0.1:{free_port()}"
    refused(["eval", "--model", "current", "--datasets", "aime24", "--server", server], server, "rlep serve eval")


@pytest.mark.parametrize("command", [["list"], ["stats", "rlep"], ["drop", "rlep", "--yes"]])
def test_pool_commands_without_a_replay_service_name_it_and_how_to_start_it(command):
    address = f"127.0.0.1:{free_port()}"
    refused(["pool", *command, "-a", address], f"replay service at {address}", "rlep serve replay")


def test_a_pool_command_quiets_retry_warnings_only_while_it_runs():
    """The learner logs each retry of a restarting service; a pool command run in the same process must not
    silence those for good (it did: the outage test of the replay client then saw no retry)."""
    import logging

    retries = logging.getLogger("rlep.common.grpc_retry")
    before = retries.level
    refused(["pool", "list", "-a", f"127.0.0.1:{free_port()}"], "replay service")
    assert retries.level == before


def test_missing_auth_token_file_is_named(tmp_path):
    missing = tmp_path / "token"
    refused(["pool", "list", "--auth-token-file", str(missing), "-a", f"127.0.0.1:{free_port()}"], str(missing))
    refused(["serve", "verifier", "--auth-token-file", str(missing), "--dry-run"], str(missing), "does not exist")


def test_empty_auth_token_file_is_named(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    refused(["pool", "list", "--auth-token-file", str(empty), "-a", f"127.0.0.1:{free_port()}"], str(empty), "empty")
    # A service reads it when it builds its server: that was a traceback (issue 31, item 9).
    text = refused(["serve", "verifier", "--auth-token-file", str(empty), "--port", "0"], str(empty), "is empty")
    assert text.count(str(empty)) == 1


def test_train_refuses_a_model_path_that_does_not_exist_before_starting_anything():
    refused(["train", "--set", "model=models/nope"], "models/nope", "does not exist", "rlep model import")


def test_train_refuses_a_folder_that_is_not_an_hf_checkpoint_and_a_gguf_file(tmp_path):
    refused(["train", "--set", f"model={tmp_path}"], str(tmp_path), "no config.json")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    refused(["train", "--set", f"model={gguf}"], str(gguf), "rlep model import")


def test_collect_refuses_a_model_path_that_does_not_exist(tmp_path):
    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["What is 1+1?"]}), data)
    refused(["collect", "--model", "models/nope", "--data", str(data)], "models/nope")
    refused(["collect", "--data", str(data)], str(data), "no reward_model column")


def test_unknown_config_key_names_the_nearest_valid_one():
    text = refused(["train", "--set", "algorithm.replayed_per_qestion=1", "--dry-run"])
    assert text == (
        "error: unknown key `algorithm.replayed_per_qestion`; did you mean `algorithm.replayed_per_question`?"
    )
    refused(["serve", "replay", "--set", "redis_ulr=redis://x", "--dry-run"], "`redis_ulr`", "`redis_url`")
    refused(["demo", "--set", "stpes=3", "--dry-run"], "`stpes`", "`steps`")


def test_config_error_without_a_near_key_lists_the_keys_of_that_section():
    with pytest.raises(ValueError) as err:
        TrainConfig.model_validate({"optim": {"zzzzzz": 1}})
    message = str(config_error(err.value, TrainConfig))
    assert message.startswith("unknown key `optim.zzzzzz`; the keys here are: ") and "lr" in message


def test_train_without_any_data_says_how_to_give_it():
    refused(["train"], "no training data given", "data.train_files")


def test_train_file_without_the_verl_columns_names_the_missing_column(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["What is 1+1?"]}), path)
    refused(["train", "--set", f"data.train_files=[{path}]"], str(path), "no reward_model column")
    refused(["train", "--set", f"data.train_files=[{tmp_path / 'gone.parquet'}]"], "gone.parquet", "does not exist")


def test_pool_import_of_a_file_that_is_not_parquet(tmp_path):
    path = tmp_path / "pool.csv"
    path.write_text("prompt,answer\n1+1,2\n")
    refused(["pool", "import", str(path), "--pool", "p", "-a", f"127.0.0.1:{free_port()}"], str(path), "not a parquet")


def test_pool_export_into_a_missing_folder(tmp_path):
    target = tmp_path / "missing" / "pool.parquet"
    refused(["pool", "export", "p", str(target), "-a", f"127.0.0.1:{free_port()}"], str(target.parent), "create it")


def test_verbose_adds_the_traceback():
    result = runner.invoke(app, ["--verbose", "train", "--set", "model=models/nope"])
    assert result.exit_code == 2
    assert "Traceback" in result.output and "error: model `models/nope`" in result.output
