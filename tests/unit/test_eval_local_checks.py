"""Issue 47 item 5: the README's checkpoint evaluation needed services nobody had started, and the refusal did not
say what to start. `rlep eval --local` starts them (the whole path: tests/e2e/test_newcomer_path.py); these are its
checks before any engine starts, and the refusals that now point to it."""

from __future__ import annotations

import sys
import types

import pytest

from rlep.common.ports import free_port
from rlep.services.eval.api import DatasetRequest, EvaluationRequest
from rlep.services.eval.config import EvalConfig
from rlep.services.eval.server import validate_request
from tests.unit.test_cli_errors import refused as refused_in_two_lines
from tests.unit.test_refused_settings import refused


@pytest.fixture
def nothing_starts(monkeypatch):
    """`rlep eval --local` fails the test if it gets as far as starting the services."""
    fake = types.ModuleType("rlep.services.launch.local_eval")

    def local_eval_services(*args, **kwargs):
        raise AssertionError("the command went on to start the services")

    fake.local_eval_services = local_eval_services
    monkeypatch.setitem(sys.modules, fake.__name__, fake)


def test_local_refuses_current_and_names_the_server_route(nothing_starts):
    refused(
        ["eval", "--local", "--model", "current", "--datasets", "amc23"], "--local evaluates a checkpoint", "--server"
    )


def test_local_refuses_what_it_would_find_out_after_the_engine_started(tmp_path, nothing_starts):
    refused_in_two_lines(
        ["eval", "--local", "--model", str(tmp_path / "nope"), "--datasets", "amc23"], "does not exist"
    )
    missing = tmp_path / "mine.parquet"
    refused(["eval", "--local", "--model", "tiny", "--datasets", str(missing)], f"--datasets {missing}: no such file")
    args = ["eval", "--local", "--model", "tiny", "--datasets", "amc23", "--set", "verifier.default_scorer=nope"]
    refused(args, "verifier")


def test_config_and_set_apply_to_local_only():
    refused(["eval", "--model", "current", "--datasets", "amc23", "--set", "seed=1"], "--local only")


def test_no_eval_service_names_local_too():
    server = f"http://127.0.0.1:{free_port()}"
    refused(["eval", "--model", "ckpt/hf", "--datasets", "amc23", "--server", server], "rlep serve eval", "--local")


def test_a_service_without_a_checkpoint_rollout_says_what_it_lacks_and_the_local_route(tmp_path):
    """Before: "evaluates only model='current' (no checkpoint_rollout)", with nothing on what to start."""
    config = EvalConfig.model_validate({"allowed_roots": [str(tmp_path)]})
    request = EvaluationRequest(model=str(tmp_path), datasets=[DatasetRequest(name="amc23", limit=1)])
    with pytest.raises(ValueError, match="no checkpoint_rollout.*docs/eval.md.*rlep eval --local --model PATH"):
        validate_request(request, config)
