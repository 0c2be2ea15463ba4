"""Issue 47, item 1: a scorer of your own reaches `rlep train` and `rlep collect` through their `verifier` section
(scorers, default_scorer, scorer_path), checked in one line before anything starts."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from rlep.services.cli.app import app
from rlep.services.learner.config import TrainConfig
from rlep.services.verifier.config import ScorerSettings
from rlep.services.verifier.python_scorer import check_scorers, use_scorer_path

runner = CliRunner()


def scorer_module(folder: Path, body: str) -> str:
    """Writes a module of `body` into `folder` under a fresh name (imports are cached per process)."""
    name = f"own_scorer_{uuid.uuid4().hex[:8]}"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(body)
    return name


def train_args(tmp_path: Path, folder: Path, function: str) -> list[str]:
    from rlep.services.demo.task import make_problems, write_parquet

    data = write_parquet(make_problems(4, 0, "train"), tmp_path / "train.parquet")
    scorers = {"my_task": {"type": "python", "function": function, "success_threshold": 0.5}}
    return ["train", "--model", "tiny", "--data", str(data), "--set", f"verifier.scorer_path=[{folder}]",
            "--set", f"verifier.scorers={json.dumps(scorers)}"]  # fmt: skip


def test_train_takes_a_scorer_from_its_own_folder_and_dry_run_shows_it(tmp_path):
    folder = tmp_path / "scorers"
    name = scorer_module(folder, "def score(response, ground_truth, extra):\n    return 1.0\n")
    result = runner.invoke(app, [*train_args(tmp_path, folder, f"{name}:score"), "--dry-run"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)["verifier"]
    assert shown["scorer_path"] == [str(folder)]
    assert shown["scorers"]["my_task"] == {
        "type": "python", "function": f"{name}:score", "success_threshold": 0.5, "error_reward": 0.0
    }  # fmt: skip
    assert str(folder) in sys.path  # where the check imported it from


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("def score(response, ground_truth):\n    return 1.0\n", "must take (response, ground_truth, extra)"),
        ("raise RuntimeError('needs a GPU')\n", "cannot be loaded: RuntimeError: needs a GPU"),
        ("score = 3\n", "is not callable"),
        (None, "No module named"),
    ],
    ids=["two-arguments", "raises-at-import", "not-callable", "missing-module"],
)
def test_a_scorer_that_cannot_run_is_refused_in_one_line_before_anything_starts(tmp_path, body, said):
    """Before: a wrong signature was every item's ERROR with nothing logged, an import error a 69-line double
    traceback from the verifier after Ray and vLLM had started."""
    folder = tmp_path / "scorers"
    folder.mkdir()
    name = scorer_module(folder, body) if body is not None else "not_written_anywhere"
    for command in ("train", "collect"):
        args = train_args(tmp_path, folder, f"{name}:score")
        result = runner.invoke(
            app, [command, *args[1:], "--steps", "1"] if command == "train" else [command, *args[1:]]
        )
        assert result.exit_code == 2, result.output
        output = " ".join(result.output.split())
        assert output.startswith(f"error: verifier: scorer function '{name}:score'") and said in output, output
        assert "Traceback" not in result.output and len(result.output.splitlines()) <= 3


def test_a_missing_scorer_folder_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"scorer_path: {missing} is not a folder"):
        check_scorers(ScorerSettings(scorer_path=[missing]))


def test_scorer_path_goes_first_once_and_relative_folders_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    settings = ScorerSettings(scorer_path=[Path("mine")])
    assert settings.scorer_path == [tmp_path / "mine"]
    monkeypatch.setattr(sys, "path", ["/usr/lib/python3"])
    use_scorer_path(settings.scorer_path)
    use_scorer_path(settings.scorer_path)
    assert sys.path == [str(tmp_path / "mine"), "/usr/lib/python3"]


def test_scorers_for_a_verifier_the_run_does_not_start_are_refused():
    """With endpoints.verifier set, a verifier section would be silently ignored: the remote verifier has its own."""
    scorers = {"my_task": {"type": "python", "function": "m:score"}}
    with pytest.raises(ValidationError, match="endpoints.verifier=verifier:50061 is used instead"):
        TrainConfig.model_validate({"endpoints": {"verifier": "verifier:50061"}, "verifier": {"scorers": scorers}})
    TrainConfig.model_validate({"endpoints": {"verifier": "verifier:50061"}})  # the default section: nothing to say


def test_the_example_in_docs_rewards_runs_as_written(tmp_path, monkeypatch):
    """docs/rewards.md's own-scorer example: its module, written as given, scores as its docstring says, and its
    `rlep train` command (with --dry-run) passes every check that runs before the stack starts."""
    import re
    import shlex

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.unit.test_architecture import ROOT

    section = (ROOT / "docs" / "rewards.md").read_text().split("## A scorer of your own")[1].split("\n## ")[0]
    module, command = re.findall(r"```(?:python|bash)\n(.*?)```", section, re.DOTALL)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_scorers").mkdir()
    (tmp_path / "my_scorers" / "length_task.py").write_text(module)
    rows = [{"prompt": [{"role": "user", "content": "Say four words."}], "data_source": "length_task",
             "reward_model": {"ground_truth": "4", "style": "rule"}}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "length.parquet")
    args = shlex.split(command.replace("\\\n", " "))
    assert args[:2] == ["rlep", "train"]
    result = runner.invoke(app, [*args[1:], "--dry-run"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["verifier"]["scorer_path"] == [str(tmp_path / "my_scorers")]
    from length_task import score  # imported by the check, from the folder the command named

    assert score("one two three four", "4", {}) == {"score": 1.0, "extracted_answer": "4"}
    assert score("one two", "4", {})["score"] == 0.0
