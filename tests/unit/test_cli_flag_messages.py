"""Issue 47 item 4: flags whose mistakes got a misleading message. Each is refused before anything starts, in one
line that names the flag and the rule (no pydantic dump, no config JSON in front, no advice to start a service
that runs).
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rlep.common.config import ServerConfig
from rlep.common.ports import free_port
from rlep.services.cli.eval import parse_datasets
from tests.unit.test_cli_errors import refused


def unreachable_eval() -> list[str]:
    """`--server` of a port nobody listens on: a request that passed the checks would say "cannot reach"."""
    return ["--server", f"http://127.0.0.1:{free_port()}"]


def test_a_folder_given_as_data_is_called_a_folder(tmp_path):
    text = refused(["train", "--data", str(tmp_path), "--dry-run"], str(tmp_path), "is a folder", "--data", "parquet")
    assert "does not exist" not in text


def test_a_jsonl_given_as_data_is_one_short_line_without_the_config_before_it(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i} + 1?" * 40, "answer": str(i + 1)}) + "\n" for i in range(200)))
    text = refused(["train", "--data", str(data), "--dry-run"], str(data), "JSON lines", "verl parquet")
    assert len(text) < 300, text


def test_a_count_that_is_no_positive_integer_is_named_not_sent_as_a_dataset():
    for item in ("amc23:two", "amc23:0"):
        refused(
            ["eval", "--model", "current", "--datasets", item, *unreachable_eval()], f"--datasets {item}", "positive"
        )


def test_dataset_names_that_hold_a_colon_are_still_names():
    assert [(d.name, d.limit) for d in parse_datasets("amc23:10,/data/a:b.jsonl,gsm8k")] == [
        ("amc23", 10),
        ("/data/a:b.jsonl", None),
        ("gsm8k", None),
    ]


@pytest.mark.parametrize("server", ["127.0.0.1:8080", "localhost:8080"])
def test_a_server_url_without_a_scheme_says_so(server):
    text = refused(["eval", "--model", "current", "--datasets", "amc23", "--server", server], f"http://{server}")
    assert "rlep serve eval" not in text


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--n", "0"], ["--n 0", "greater than or equal to 1"]),
        (["--temperature", "0", "--n", "4"], ["--n 4", "--temperature 0", "identical samples"]),
        (["--top-p", "0"], ["--top-p 0", "greater than 0"]),
    ],
)
def test_sampling_flags_out_of_bounds_get_one_line_naming_the_flag(flags, needles):
    refused(["eval", "--model", "current", "--datasets", "amc23", *flags, *unreachable_eval()], *needles)


def test_the_same_port_for_grpc_and_metrics_is_refused_by_the_config():
    port = free_port()
    with pytest.raises(ValidationError, match=f"port and metrics_port are the same \\({port}\\)"):
        ServerConfig(port=port, metrics_port=port)
    ServerConfig(port=0, metrics_port=0)  # two free ports, picked apart


@pytest.mark.parametrize("service", ["verifier", "replay", "rollout"])
def test_serve_with_the_same_port_twice_says_so_before_binding(service):
    port = str(free_port())
    text = refused(["serve", service, "--port", port, "--metrics-port", port, "--dry-run"], "same", "--metrics-port")
    assert "in use" not in text
    args = ["serve", service, "--metrics-port", port, "--health-port", port, "--dry-run"]
    text = refused(args, "same", "--health-port")
    assert "metrics_port and health_port are the same" in text
