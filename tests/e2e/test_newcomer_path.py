"""Issue 47's acceptance: a newcomer's own task from the README and docs only, as commands in a shell.

A scorer module of their own and a verl parquet whose `data_source` names it: the only files written by hand.
Then `rlep train` (configs/train.yaml at a small size, vLLM eager, the scorer given with --set as docs/rewards.md
shows) and `rlep eval --local --samples` of the checkpoint it wrote (the README's step 4). The samples must carry the
scores of the user's function, recomputed here from each response, not math-verify's 0/1.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.service_process import rlep_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).parents[2]
SCORER = '''
def score(response, ground_truth, extra):
    """A made-up task: a quarter point per character, up to 4."""
    return min(len(response.strip()), 4) / 4
'''


def own_score(response: str) -> float:
    return min(len(response.strip()), 4) / 4


def write_task(path: Path, count: int) -> Path:
    """What a user writes with pyarrow: verl columns, their own data_source label."""
    rows = [
        {
            "data_source": "my_task",
            "prompt": [{"role": "user", "content": f"Say the word number {i} in French."}],
            "reward_model": {"ground_truth": str(i), "style": "rule"},
        }
        for i in range(count)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    result = subprocess.run([*rlep_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"rlep {' '.join(args[:2])}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_own_scorer_through_train_and_a_local_eval_of_its_checkpoint(tmp_path):
    (tmp_path / "scorers").mkdir()
    (tmp_path / "scorers" / "my_scorer.py").write_text(SCORER)
    data = write_task(tmp_path / "my_task.parquet", 8)
    own = "{my_task: {type: python, function: 'my_scorer:score', success_threshold: 0.5}}"
    scorer = ["--set", "verifier.scorer_path=[scorers]", "--set", f"verifier.scorers={own}"]
    small = [f"algorithm.{key}" for key in ("questions_per_step=4", "fresh_per_question=4", "max_response_tokens=16",
             "overlong_buffer_tokens=4", "mini_batch_questions=2")]  # fmt: skip
    # Eager vLLM: a compiled start costs ~40 CPU-seconds more each (two here); `test_doctor` starts the compiled one.
    eager = ["--set", "local.rollout_engine.enforce_eager=true"]
    small += ["checkpoint.dir=run", "metrics_port=null"]
    train = ["train", "--config", str(REPO / "configs" / "train.yaml"), "--model", "tiny", "--data", data.name]
    train += ["--pool", "mine", "--steps", "2", *scorer, *eager, *(arg for s in small for arg in ("--set", s))]
    trained = run(train, tmp_path, 540)
    # Its output is a pipe: a line per step (issue 47 item 6).
    steps = [line.split(" step ")[1][:3] for line in trained.stdout.splitlines() if line.startswith("rlep step ")]
    assert steps == ["1/2", "2/2"], trained.stdout[-2000:]

    checkpoint = tmp_path / "run" / "step_2" / "hf"
    assert checkpoint.is_dir(), sorted(p.name for p in (tmp_path / "run").iterdir())
    evaluate = ["eval", "--local", "--model", "run/step_2/hf", "--datasets", data.name, "--n", "2"]
    evaluate += ["--max-tokens", "8", "--samples", "samples.jsonl", "--config", str(REPO / "configs" / "train.yaml")]
    evaluated = run([*evaluate, *scorer, *eager], tmp_path, 400)
    assert "run/step_2/hf: job" in evaluated.stdout and "succeeded" in evaluated.stdout, evaluated.stdout[-2000:]

    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 * 2
    assert {s["data_source"] for s in samples} == {"my_task"}
    assert [s["score"] for s in samples] == [own_score(s["response"]) for s in samples]
    assert {s["verdict"] for s in samples} <= {"correct", "wrong"}
    assert all(s["verdict"] == ("correct" if s["score"] >= 0.5 else "wrong") for s in samples)
