"""The closed loop for real: vLLM rollout on Ray Serve, verifier, replay over Redis, DeepSpeed learner actors."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlep_common.dataset import question_id
from rlep_common.types import Trajectory, Verdict

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA_SOURCE = "test-arith"


def arithmetic_parquet(path: Path, count: int, seed: int = 0) -> list[dict]:
    """A verl-schema file of `a+b` questions (what DAPO-17k looks like, in miniature)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        a, b = (int(x) for x in torch.randint(1, 50, (2,), generator=generator))
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}+{b}=?"}],
                "ability": "math",
                "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return rows


def train_config(tmp_path: Path, data: Path, **algorithm):
    from services.learner.config import TrainConfig

    return TrainConfig.model_validate(
        {
            "run_id": "loop-test",
            "model": "tiny",
            "seed": 3,
            "steps": 3,
            "replay_pool": f"loop-{tmp_path.name}",
            "algorithm": {
                "questions_per_step": 4,
                "fresh_per_question": 4,
                "replayed_per_question": 2,
                "max_response_tokens": 16,
                "overlong_buffer_tokens": 4,
                "mini_batch_questions": 2,
                **algorithm,
            },
            "optim": {"lr": 1e-3, "warmup_steps": 1, "micro_batch_size": 8},
            "deepspeed": {"zero_stage": 2},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 2},
            "data": {"train_files": [str(data)]},
            "local": {
                "rollout_cpus": 0.5,
                "learner_cpus": 0.5,
                "rollout_engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256},
            },
        }
    )


@pytest.fixture(scope="module")
def loop_stack(ray_local, tmp_path_factory, redis_url):
    """Rollout (Ray Serve), verifier and replay (Ray actors) for the whole module."""
    from rlep_common.tiny_model import cached_model
    from services.learner.launch import LocalStack

    tmp = tmp_path_factory.mktemp("stack")
    config = train_config(tmp, tmp / "unused.parquet")
    config = config.model_copy(update={"local": config.local.model_copy(update={"replay_redis_url": redis_url})})
    stack = LocalStack(config, cached_model("tiny"), app_name="rlep-rollout-loop")
    stack.start(need_replay=True)
    yield stack
    stack.close()


def seed_pool(stack, pool: str, rows: list[dict], per_question: int = 3) -> None:
    """Stores verified-correct answers for every question, as phase-1 collection would."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack.model_dir)
    trajectories = []
    for row in rows:
        prompt_text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tuple(tokenizer.encode(prompt_text, add_special_tokens=False))
        qid = question_id(row["prompt"])
        truth = row["reward_model"]["ground_truth"]
        for k in range(per_question):
            text = f"{' ' * k}\\boxed{{{truth}}}"
            response_ids = (*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id)
            trajectories.append(
                Trajectory(
                    qid,
                    text,
                    1.0,
                    verdict=Verdict.CORRECT,
                    prompt_token_ids=prompt_ids,
                    response_token_ids=response_ids,
                )
            )
    stack.services.replay.add(pool, trajectories)


def test_rlep_steps_train_replay_and_push(loop_stack, tmp_path):
    from services.learner.main import run_training

    rows = arithmetic_parquet(tmp_path / "train.parquet", 12)
    config = train_config(tmp_path, tmp_path / "train.parquet")
    seed_pool(loop_stack, config.replay_pool, rows)
    before = loop_stack.services.rollout.versions()

    records = run_training(config, stack=loop_stack, show_progress=False)

    assert [r["step"] for r in records] == [1, 2, 3]
    algo = config.algorithm
    expected_fraction = algo.replayed_per_question / (algo.fresh_per_question + algo.replayed_per_question)
    assert all(r["replayed_fraction"] == pytest.approx(expected_fraction) for r in records)
    assert all(r["sequences"] == algo.questions_per_step * 6 for r in records)
    # Every replica ends on the learner's final version, one push per step after the initial one.
    assert loop_stack.services.rollout.versions() == [records[-1]["policy_version"]]
    assert records[-1]["policy_version"] == max(before) + 1 + 3
    # The weights moved: the final checkpoint differs from the starting model.
    from safetensors.torch import load_file

    start = load_file(str(loop_stack.model_dir / "model.safetensors"))
    final = load_file(str(tmp_path / "ckpt" / "step_3" / "hf" / "model.safetensors"))
    changed = [k for k in start if not torch.equal(start[k], final[k])]
    assert len(changed) == len(start), f"unchanged tensors: {set(start) - set(changed)}"
    log = [json.loads(line) for line in (tmp_path / "ckpt" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert all(set(r["phase_seconds"]) == {"rollout", "verify", "replay", "train", "weight_push"} for r in log)


def _log_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_killed_learner_resumes_without_skipping_or_repeating(loop_stack, tmp_path, ray_local):
    """`rlep train` is killed (-9) after its step-2 checkpoint; `--resume` replays the exact question schedule."""
    import os
    import signal
    import subprocess
    import time

    import yaml

    from services.learner.data import DataCursor, load_questions
    from tests.integration.test_serve_cli import rlep_command

    rows = arithmetic_parquet(tmp_path / "train.parquet", 10, seed=1)
    config = train_config(tmp_path, tmp_path / "train.parquet").model_dump(mode="json")
    services = loop_stack.services
    config["steps"] = 6
    config["endpoints"] = {
        "rollout": [r.address for r in services.rollout.replicas],
        "verifier": loop_stack.addresses["verifier"],
        "replay": loop_stack.addresses["replay"],
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    seed_pool(loop_stack, config["replay_pool"], rows)
    pool_before = services.replay.stats(config["replay_pool"]).trajectories
    command = [*rlep_command(), "train", "--config", str(tmp_path / "train.yaml")]
    command += ["--ray-address", ray_local.get_runtime_context().gcs_address]
    log_path = tmp_path / "ckpt" / "log.jsonl"

    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while len(_log_steps(log_path)) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    done_before_kill = [r["step"] for r in _log_steps(log_path)]
    assert 3 <= len(done_before_kill) < 6, done_before_kill

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    records = _log_steps(log_path)
    after_resume = records[len(done_before_kill) :]
    assert [r["step"] for r in after_resume] == [3, 4, 5, 6]  # continued from the step-2 checkpoint
    questions = load_questions([tmp_path / "train.parquet"])
    cursor = DataCursor(len(questions), config["seed"], shuffle=True)
    schedule = [[questions[i].question_id for i in cursor.next_indices(4)] for _ in range(6)]
    by_step = {r["step"]: r["question_ids"] for r in records}  # the resumed run's record wins for a step
    assert [by_step[s] for s in range(1, 7)] == schedule
    assert services.replay.stats(config["replay_pool"]).trajectories == pool_before  # the pool is untouched


def test_collect_samples_verifies_and_resumes(loop_stack, tmp_path):
    from services.learner.collect import CollectConfig, collect
    from services.learner.data import load_questions

    arithmetic_parquet(tmp_path / "train.parquet", 6, seed=5)
    questions = load_questions([tmp_path / "train.parquet"])
    config = CollectConfig(samples_per_question=4, max_response_tokens=12, questions_per_chunk=4, min_successes=1)
    state = tmp_path / "collect.json"
    pool = f"collect-{tmp_path.name}"
    stats = collect(loop_stack.services, questions, pool, config, state_file=state, show_progress=False)
    assert (stats.questions, stats.samples, stats.chunks_done) == (6, 24, 2)
    assert json.loads(state.read_text())["chunks_done"] == 2
    again = collect(loop_stack.services, questions, pool, config, state_file=state, show_progress=False)
    assert again.samples == 24  # resumed past the finished chunks: nothing sampled twice


def test_training_file_with_candidates_seeds_the_pool(loop_stack, tmp_path):
    """RLEP's released training file (reward_model.candidates, text only) works as is: `rlep train` imports it."""
    from services.learner.main import run_training
    from services.learner.pool_seed import seed_pool_from_candidates

    rows = arithmetic_parquet(tmp_path / "plain.parquet", 8, seed=7)
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        row["reward_model"]["candidates"] = [f"\\boxed{{{truth}}}", f"so \\boxed{{{truth}}}"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "with-pool.parquet")
    pool = f"candidates-{uuid.uuid4().hex[:12]}"  # the CI Redis outlives test runs
    config = train_config(tmp_path, tmp_path / "with-pool.parquet").model_copy(update={"steps": 1, "replay_pool": pool})
    replay = loop_stack.services.replay
    assert pool not in replay.list_pools()

    records = run_training(config, stack=loop_stack, show_progress=False)

    algo = config.algorithm
    requested = algo.questions_per_step * algo.replayed_per_question
    assert (records[0]["replay_used"], records[0]["replay_retokenized"]) == (requested, requested)
    assert replay.stats(config.replay_pool).trajectories == 2 * len(rows)
    assert seed_pool_from_candidates(replay, config.replay_pool, [tmp_path / "with-pool.parquet"]) == 0  # idempotent
    assert seed_pool_from_candidates(replay, config.replay_pool, [tmp_path / "plain.parquet"]) == 0  # no candidates
    replay.drop(pool, confirm=pool)
