"""The closed loop for real: vLLM rollout on Ray Serve, verifier, replay over Redis, DeepSpeed learner actors."""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlep.services.learner.config import TrainConfig
from rlep.services.learner.records import LogRecord, StepRecord, read_step_log
from tests.checkpoint_util import assert_same_tree, deepspeed_state
from tests.loop_util import AnsweringRollout, WellFormedEquation, arithmetic_parquet, seed_pool, train_config
from tests.tracking_util import jsonl_scalars, read_scalars

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# A scorer of the user's own (issue 47): a module in a folder of its own, found through `verifier.scorer_path` by
# the verifier the stack starts and by its worker processes; countdown's scale, tripled, so its items are told apart.
OWN_SCORER = """
from rlep.services.verifier.countdown import score as countdown


def score(response, ground_truth, extra):
    result = countdown(response, ground_truth, extra)
    return result | {"score": 3 * result["score"]}


def broken(response, ground_truth, extra):
    raise KeyError("words")
"""
BUILTIN_COUNTDOWN = {"type": "python", "function": "rlep.services.verifier.countdown:score"}


@pytest.fixture(scope="module")
def loop_stack(ray_local, tmp_path_factory, redis_url):
    """Rollout (Ray Serve), verifier and replay (Ray actors) for the whole module."""
    from rlep.common.tiny_model import cached_model
    from rlep.services.launch.stack import ServiceStack

    tmp = tmp_path_factory.mktemp("stack")
    config = train_config(tmp, tmp / "unused.parquet")
    (tmp / "scorers").mkdir()
    (tmp / "scorers" / "tripled_countdown.py").write_text(OWN_SCORER)
    verifier = {"scorer_path": [str(tmp / "scorers")], "scorers": {"countdown": BUILTIN_COUNTDOWN, "my_countdown": {
        "type": "python", "function": "tripled_countdown:score", "success_threshold": 3.0},
        "broken": {"type": "python", "function": "tripled_countdown:broken", "error_reward": -0.5}}}  # fmt: skip
    config = TrainConfig.model_validate(
        config.model_dump()
        | {"verifier": verifier, "local": config.local.model_dump() | {"replay_redis_url": redis_url}}
    )
    stack = ServiceStack(config, cached_model("tiny"), app_name="rlep-rollout-loop")
    stack.start(need_replay=True)
    yield stack
    stack.close()


def test_rlep_steps_train_replay_and_push(loop_stack, tmp_path, caplog):
    """Three RLEP steps; after each, the learner's /metrics (bearer token required) shows that step's figures. At
    start, one line says which dtype each side runs in (here both float32: no warning)."""
    import urllib.error

    from rlep.services.launch.training import run_training
    from tests.conftest import free_port
    from tests.metrics_util import scrape, series_value

    rows = arithmetic_parquet(tmp_path / "train.parquet", 12)
    (tmp_path / "token").write_text("learner-metrics-token\n")
    config = train_config(tmp_path, tmp_path / "train.parquet")
    # The token file protects /metrics only: the stack's services were started without one.
    endpoints = config.endpoints.model_copy(update={"auth_token_file": tmp_path / "token"})
    checkpoint = config.checkpoint.model_copy(update={"keep_last": 1})
    config = config.model_copy(update={"metrics_port": free_port(), "endpoints": endpoints, "checkpoint": checkpoint})
    seed_pool(loop_stack, config.replay_pool, rows)
    before = loop_stack.services.rollout.versions()
    scraped, refused = [], []

    def scrape_metrics(record: StepRecord) -> None:
        """Runs inside the step loop: the server is up while training runs."""
        try:
            scrape(config.metrics_port)
        except urllib.error.HTTPError as err:
            refused.append(err.code)
        scraped.append((record, scrape(config.metrics_port, token="learner-metrics-token")))

    with caplog.at_level(logging.INFO, logger="rlep.services.launch.training"):
        records = run_training(config, stack=loop_stack, show_progress=False, on_step=scrape_metrics)

    [dtypes] = [r for r in caplog.records if r.getMessage().startswith("dtypes:")]
    assert {s.dtype for s in loop_stack.services.rollout.status()} == {"float32"}  # what the replicas report
    assert dtypes.getMessage() == "dtypes: the learner trains in float32, the rollout replicas sample in float32"
    assert dtypes.levelno == logging.INFO
    assert refused == [401] * 3
    # Float32 on both sides: the train/inference mismatch is only the kernels' (vLLM CPU against HF), and small.
    for record in records:
        assert 0.0 <= record.rollout_mismatch_kl < 1e-3 and record.rollout_mismatch_outside_cap == 0.0
        assert 1.0 <= record.rollout_mismatch_ratio_max < 1.5
    for record, text in scraped:
        for key, series in (("step", "rlep_learner_step"), ("policy_version", "rlep_learner_policy_version")):
            assert series_value(text, series) == getattr(record, key), series
        assert "rlep_learner_eval_accuracy" not in text  # periodic eval is off: no accuracy, not 0.0
        for key in ("reward_mean", "replayed_fraction", "replay_used", "replay_requested", "advantage_std"):
            assert series_value(text, f"rlep_learner_{key}") == pytest.approx(getattr(record, key)), key
        for phase, seconds in record.phase_seconds.items():
            assert series_value(text, f'rlep_learner_step_seconds{{phase="{phase}"}}') == pytest.approx(seconds)
    totals = {phase: sum(r.phase_seconds[phase] for r in records) for phase in records[0].phase_seconds}
    for phase, seconds in totals.items():
        assert series_value(scraped[-1][1], f'rlep_learner_phase_seconds_total{{phase="{phase}"}}') == pytest.approx(
            seconds
        )
    assert [r.step for r in records] == [1, 2, 3]
    algo = config.algorithm
    expected_fraction = algo.replayed_per_question / (algo.fresh_per_question + algo.replayed_per_question)
    assert all(r.replayed_fraction == pytest.approx(expected_fraction) for r in records)
    assert all(r.sequences == algo.questions_per_step * 6 for r in records)
    # Every replica ends on the learner's final version, one push per step after the initial one.
    assert loop_stack.services.rollout.versions() == [records[-1].policy_version]
    assert records[-1].policy_version == max(before) + 1 + 3
    # The weights moved: the final checkpoint differs from the starting model.
    from safetensors.torch import load_file

    start = load_file(str(loop_stack.model_dir / "model.safetensors"))
    final = load_file(str(tmp_path / "ckpt" / "step_3" / "hf" / "model.safetensors"))
    changed = [k for k in start if not torch.equal(start[k], final[k])]
    assert len(changed) == len(start), f"unchanged tensors: {set(start) - set(changed)}"
    # keep_last=1: step 2's checkpoint (DeepSpeed state and HF export) is gone once step 3's is written.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_3"]
    from rlep.common.policy_info import policy_version_of

    assert policy_version_of(tmp_path / "ckpt" / "step_3" / "hf") == records[-1].policy_version
    sizes = {
        part: sum(f.stat().st_size for f in files if f.is_file())
        for part, files in (
            ("deepspeed", [f for f in (tmp_path / "ckpt" / "step_3").iterdir() if f.name != "hf"]),
            ("hf", list((tmp_path / "ckpt" / "step_3" / "hf").iterdir())),
        )
    }
    print(f"\ntiny checkpoint bytes: {sizes}")  # docs/learner.md, *Checkpoints*
    log = read_step_log(tmp_path / "ckpt" / "log.jsonl")
    assert log == records  # the log holds the returned records, every field as it was
    # A few responses per step for a person to read: 4 (the default) per step, the last one replayed when the step
    # replayed, in generations.jsonl beside the log and as TensorBoard text.
    from tests.tracking_util import read_texts

    logged = [json.loads(line) for line in (tmp_path / "ckpt" / "generations.jsonl").read_text().splitlines()]
    for record in records:
        rows = [row for row in logged if row["step"] == record.step]
        assert len(rows) == 4 and {row["question_id"] for row in rows} <= set(record.question_ids)
        assert [row["source"] for row in rows] == ["fresh"] * 3 + ["replay" if record.replay_used else "fresh"]
        assert all(row["policy_version"] <= record.policy_version for row in rows)
    texts = read_texts(tmp_path / "ckpt" / "tensorboard", "generations")
    assert sorted(texts) == [r.step for r in records]
    assert all(row["response"].split("\n")[0].replace("|", "\\|") in texts[row["step"]] for row in logged)
    assert all(
        set(r.phase_seconds) == {"rollout", "verify", "replay", "train", "weight_push", "rollout_wait"} for r in log
    )
    assert all(r.policy_staleness_max == 0 and r.groups_dropped_stale == 0 for r in log)  # synchronous steps
    # TensorBoard (on by default, under the checkpoint dir) holds the JSONL's figures, per step and name.
    scalars, expected = read_scalars(tmp_path / "ckpt" / "tensorboard"), jsonl_scalars(log)
    assert scalars.keys() == expected.keys() and "phase_seconds/train" in scalars
    for name, by_step in expected.items():
        assert scalars[name] == pytest.approx(by_step, rel=1e-6), name


class OverlappedRun(NamedTuple):
    records: list[StepRecord]
    log: list[LogRecord]
    lingering_step: float  # rlep_learner_step scraped once the step loop had ended, while /metrics lingered
    lingered_s: float  # from the linger's announcement to run_training's return
    after_linger: Exception | None  # what a scrape raised once run_training had returned
    replica_versions: list[int]  # the replicas' policy versions once it had returned


@pytest.fixture(scope="module")
def overlapped_run(loop_stack, tmp_path_factory) -> OverlappedRun:
    """Three steps with max_staleness=1 and metrics_linger_s=6, on the real stack: run_training in a thread, /metrics
    scraped when it announces the linger (its step loop has ended) and again once it has returned."""
    import threading

    from rlep.services.launch.training import run_training
    from tests.conftest import free_port
    from tests.metrics_util import scrape, series_value

    tmp_path = tmp_path_factory.mktemp("overlapped")
    rows = arithmetic_parquet(tmp_path / "train.parquet", 12)
    config = train_config(tmp_path, tmp_path / "train.parquet", max_staleness=1)
    config = config.model_copy(update={"metrics_port": free_port(), "metrics_linger_s": 6.0})
    seed_pool(loop_stack, config.replay_pool, rows)
    lingering = threading.Event()

    class OnLinger(logging.Handler):  # run_training announces the linger once the step loop has ended
        def emit(self, record: logging.LogRecord) -> None:
            if "keeping /metrics up" in record.getMessage():
                lingering.set()

    handler, logger = OnLinger(), logging.getLogger("rlep.services.launch.training")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    records: list[StepRecord] = []
    training = threading.Thread(
        target=lambda: records.extend(run_training(config, stack=loop_stack, show_progress=False))
    )
    try:
        training.start()
        while not lingering.wait(1):
            assert training.is_alive(), "run_training ended without keeping /metrics up"
        announced = time.monotonic()
        lingering_step = series_value(scrape(config.metrics_port), "rlep_learner_step")
        training.join(120)
        lingered_s = time.monotonic() - announced
        assert not training.is_alive(), "run_training did not return within 120 s of its linger"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    try:
        scrape(config.metrics_port)
        after_linger = None
    except Exception as err:  # noqa: BLE001 - the test looks at which
        after_linger = err
    log = read_step_log(tmp_path / "ckpt" / "log.jsonl")
    versions = loop_stack.services.rollout.versions()
    return OverlappedRun(records, log, lingering_step, lingered_s, after_linger, versions)


def test_metrics_outlive_the_last_step_by_metrics_linger_s(overlapped_run):
    """A short job's final figures stay scrapable after its last step (Prometheus scrapes every 15-30 s); the
    server stops when the linger ends."""
    import urllib.error

    assert [r.step for r in overlapped_run.records] == [1, 2, 3]
    assert overlapped_run.lingering_step == 3  # after the last step
    # metrics_linger_s is 6: the announcement is seen a moment after it is made. Without the linger, what is left
    # between the two is the teardown (the learner actor's stop, the server's), ~1 s.
    assert overlapped_run.lingered_s > 5.5, overlapped_run.lingered_s
    assert isinstance(overlapped_run.after_linger, urllib.error.URLError), overlapped_run.after_linger


def test_overlapped_steps_train_on_samples_one_version_old(overlapped_run):
    """max_staleness=1 on the real stack: after the first step, each step's samples were generated while the
    previous step trained (one version old), replay is mixed in as before, and the replicas end on the last push."""
    records = overlapped_run.records
    assert [r.step for r in records] == [1, 2, 3]
    assert records[0].policy_staleness_max == 0
    assert [r.policy_staleness_max for r in records[1:]] == [1, 1]
    assert all(r.groups_dropped_stale == 0 and r.replay_used == 2 * 4 for r in records)
    assert overlapped_run.replica_versions == [records[-1].policy_version]
    assert overlapped_run.log == records


def _log_steps(path: Path) -> list[LogRecord]:
    return read_step_log(path) if path.exists() else []


# pyproject's per-test timeout is 600 s; the module's stack may start inside it (first test to run).
RESUME_TEST_BUDGET_S = 540


def _left(started: float) -> float:
    return max(1.0, RESUME_TEST_BUDGET_S - (time.monotonic() - started))


def test_killed_learner_resumes_without_skipping_or_repeating(loop_stack, tmp_path, ray_local):
    """`rlep train` dies by SIGKILL right after its step-2 checkpoint; `--resume` runs steps 3-4 with the exact
    question schedule and ends on the weights and optimizer state of an uninterrupted run."""
    import signal
    import subprocess

    import yaml
    from safetensors.torch import load_file

    from rlep.services.launch.training import run_training
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.cursor import DataCursor, load_questions
    from tests.service_process import rlep_command

    started = time.monotonic()
    rows = arithmetic_parquet(tmp_path / "train.parquet", 10, seed=1)
    config = train_config(tmp_path, tmp_path / "train.parquet").model_dump(mode="json")
    services = loop_stack.services
    config["steps"] = 4
    config["endpoints"] = {
        "rollout": [r.address for r in services.rollout.replicas],
        "verifier": loop_stack.addresses["verifier"],
        "replay": loop_stack.addresses["replay"],
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    seed_pool(loop_stack, config["replay_pool"], rows)
    pool_before = services.replay.stats(config["replay_pool"]).trajectories
    args = ["train", "--config", str(tmp_path / "train.yaml")]
    args += ["--ray-address", ray_local.get_runtime_context().gcs_address]
    command = [*rlep_command(), *args]
    log_path = tmp_path / "ckpt" / "log.jsonl"

    # The same command, run through a wrapper that SIGKILLs it right after the step-2 checkpoint.
    dying = [sys.executable, str(Path(__file__).parents[1] / "kill_after_checkpoint.py"), "2", *command[1:]]
    first = subprocess.run(dying, capture_output=True, text=True, timeout=_left(started))
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert [r.step for r in _log_steps(log_path)] == [1, 2]  # killed right after the step-2 checkpoint
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_2"

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=_left(started))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Its output is a pipe, where a progress bar draws nothing: a line per step instead (issue 47 item 6).
    lines = [line for line in resumed.stdout.splitlines() if f"{config['run_id']} step " in line]
    assert [line.split(" step ")[1].split(":")[0] for line in lines] == ["3/4", "4/4"], resumed.stdout[-2000:]

    records = _log_steps(log_path)
    assert [r.step for r in records] == [1, 2, 3, 4]  # continued from the step-2 checkpoint, nothing redone
    versions = [r.policy_version for r in records]
    assert versions == sorted(set(versions)), versions  # versions only grow, across the resume too
    from rlep.common.policy_info import policy_version_of

    assert policy_version_of(tmp_path / "ckpt" / "step_4" / "hf") == versions[-1]
    questions = load_questions([tmp_path / "train.parquet"])
    cursor = DataCursor(len(questions), config["seed"], shuffle=True)
    schedule = [[questions[i].question_id for i in cursor.next_indices(4)] for _ in range(4)]
    assert [r.question_ids for r in records] == schedule
    assert services.replay.stats(config["replay_pool"]).trajectories == pool_before  # the pool is untouched

    # Issue 47 item 3: the checkpoint says what it trained, so these are answered before anything starts.
    from rlep.services.learner.checkpoint_info import INFO_FILE

    info = json.loads((tmp_path / "ckpt" / "step_4" / INFO_FILE).read_text())
    assert (info["step"], info["lora_rank"]) == (4, 0)
    # Both are answered before Ray or a service is reached: the command runs in this process (two fewer starts).
    from typer.testing import CliRunner

    from rlep.services.cli.app import app

    again = CliRunner().invoke(app, [*args, "--resume"])
    assert again.exit_code == 0 and "at step 4 and this run trains 4 steps: nothing to do" in again.stdout
    refused = CliRunner().invoke(app, [*args, "--resume", "--set", "lora.rank=4"])
    assert refused.exit_code == 2 and "was trained with full fine-tuning" in refused.stderr, refused.output[-2000:]
    assert [r.step for r in _log_steps(log_path)] == [1, 2, 3, 4]

    # The same run without the kill, on the same services: same rewards, same weights, same optimizer state.
    checkpoint = {**config["checkpoint"], "dir": str(tmp_path / "reference")}
    reference = TrainConfig.model_validate({**config, "endpoints": {}, "checkpoint": checkpoint})
    uninterrupted = run_training(reference, stack=loop_stack, show_progress=False)
    assert [r.question_ids for r in uninterrupted] == schedule
    assert [r.reward_mean for r in uninterrupted] == [r.reward_mean for r in records]
    final = load_file(str(tmp_path / "ckpt" / "step_4" / "hf" / "model.safetensors"))
    expected = load_file(str(tmp_path / "reference" / "step_4" / "hf" / "model.safetensors"))
    assert assert_same_tree(final, expected) == len(expected)
    (model_states, optim_states), (ref_model, ref_optim) = (
        deepspeed_state(tmp_path / "ckpt" / "step_4"),
        deepspeed_state(tmp_path / "reference" / "step_4"),
    )
    assert assert_same_tree(model_states["module"], ref_model["module"]) == len(ref_model["module"])
    assert assert_same_tree(optim_states["optimizer_state_dict"], ref_optim["optimizer_state_dict"]) > 0
    for key in ("step", "cursor", "optimizer_steps", "training_steps", "shuffle_rng"):
        assert_same_tree(model_states[key], ref_model[key], key)
    assert time.monotonic() - started < RESUME_TEST_BUDGET_S


def test_collect_samples_verifies_and_resumes(loop_stack, tmp_path):
    """Only verified successes reach the pool; a rerun after a finished collection samples nothing."""
    from dataclasses import replace

    from rlep.services.learner.collect import CollectConfig, collect
    from rlep.services.learner.cursor import load_questions
    from rlep.services.learner.step_inputs import ServiceClients

    arithmetic_parquet(tmp_path / "train.parquet", 6, seed=5)
    questions = load_questions([tmp_path / "train.parquet"])
    rollout = AnsweringRollout(loop_stack.services.rollout)
    services = ServiceClients(rollout, loop_stack.services.verifier, loop_stack.services.replay)
    config = CollectConfig(samples_per_question=4, max_response_tokens=12, questions_per_chunk=4, min_successes=1)
    state = tmp_path / "collect.json"
    pool = f"collect-{uuid.uuid4().hex[:12]}"  # the CI Redis outlives test runs
    replay = loop_stack.services.replay
    stats = collect(services, questions, pool, config, state_file=state, show_progress=False)
    assert (stats.questions, stats.samples, stats.chunks_done, rollout.calls) == (6, 24, 2, 2)
    # One success per question (sample 0); the wrong sums and the model's own samples are not stored.
    assert (stats.successes, stats.questions_kept, stats.successes_stored) == (6, 6, 6)
    stored = replay.sample(pool, [q.question_id for q in questions], m=4, seed=0)
    assert {qid: [t.response_text for t in ts] for qid, ts in stored.items()} == {
        q.question_id: [f"\\boxed{{{q.ground_truth}}}"] for q in questions
    }
    assert json.loads(state.read_text())["chunks_done"] == 2

    again = collect(services, questions, pool, config, state_file=state, show_progress=False)
    assert rollout.calls == 2  # resumed past the finished chunks: nothing sampled again
    assert (again.samples, again.successes_stored) == (24, 6)
    assert replay.stats(pool).trajectories == 6

    # Gold answers that no sample matches: the verifier says WRONG to every parseable one, nothing is stored.
    off = [replace(q, ground_truth=str(int(q.ground_truth) + 2)) for q in questions]
    wrong_pool = f"{pool}-wrong"
    none = collect(services, off, wrong_pool, config, show_progress=False)
    assert (none.samples, none.successes, none.successes_stored) == (24, 0, 0)
    assert wrong_pool not in replay.list_pools()
    replay.drop(pool, confirm=pool)


def test_training_file_with_candidates_seeds_the_pool(loop_stack, tmp_path):
    """RLEP's released training file (reward_model.candidates, text only) works as is: `rlep train` imports it."""
    from rlep.services.launch.training import run_training
    from rlep.services.learner.pool_seed import seed_pool_from_candidates

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
    assert (records[0].replay_used, records[0].replay_retokenized) == (requested, requested)
    assert replay.stats(config.replay_pool).trajectories == 2 * len(rows)
    assert seed_pool_from_candidates(replay, config.replay_pool, [tmp_path / "with-pool.parquet"]) == 0  # idempotent
    assert seed_pool_from_candidates(replay, config.replay_pool, [tmp_path / "plain.parquet"]) == 0  # no candidates
    replay.drop(pool, confirm=pool)


def test_countdown_runs_are_scored_by_the_built_in_and_an_own_scorer(loop_stack, tmp_path, monkeypatch, caplog):
    """Issue 33, part 4, end to end: questions whose data_source is `countdown` reach the verifier with it, which
    routes them to the built-in countdown scorer (TinyZero's scale: 1 right, 0.1 a wrong equation, 0 none), not to
    math-verify, whose verdict on any of them would be a wrong answer and reward_wrong (-1). Issue 47: those labelled
    `my_countdown` go to the run's own scorer module (the `verifier` section of the stack's config), tripled, and
    one labelled `broken` to an own scorer that raises: its samples get its error_reward, and the step says so."""
    from dataclasses import replace

    from rlep.services.launch.training import run_training
    from rlep.services.verifier.countdown import FORMAT_SCORE, countdown_rows

    labels = ["countdown", "my_countdown", "my_countdown", "broken"]  # one step's 4 questions
    rows = [row | {"data_source": label} for row, label in zip(countdown_rows(4, seed=1), labels, strict=True)]
    data = tmp_path / "countdown.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    config = train_config(tmp_path, data, replayed_per_question=0, overlong_buffer_tokens=0)
    services = loop_stack.services
    monkeypatch.setattr(loop_stack, "services", replace(services, rollout=WellFormedEquation(services.rollout)))
    caplog.set_level(logging.WARNING, logger="rlep.services.learner.trainer")
    [record] = run_training(config.model_copy(update={"steps": 1}), stack=loop_stack, show_progress=False)
    assert record.sequences == 16  # 4 questions x 4 fresh samples
    # One wrong equation (0.1, tripled 0.3) and three answerless samples (0) per question; math-verify: -1 each;
    # the broken scorer's 4 samples: its error_reward.
    assert record.reward_mean == pytest.approx((FORMAT_SCORE + 2 * 3 * FORMAT_SCORE + 4 * -0.5) / 16)
    assert record.fresh_accuracy == 0.0
    assert record.scorer_failures == 4 / 16
    assert "the verifier could not score 25% of the fresh samples" in caplog.text


def test_a_lora_run_pushes_merged_weights_the_replicas_sample_from(loop_stack, tmp_path):
    """`rlep train` with LoRA through the whole stack: every step pushes the merged model, so the replicas sample
    from the very policy the learner trains (the float32 mismatch stays the kernels' own); the exported checkpoint is
    plain and differs from the start only in the adapted weights; the DeepSpeed state holds only the adapters."""
    from safetensors.torch import load_file

    from rlep.services.launch.training import run_training
    from rlep.services.learner.config import LORA_TARGETS, LoraConfig

    arithmetic_parquet(tmp_path / "train.parquet", 8, seed=5)
    config = train_config(tmp_path, tmp_path / "train.parquet", replayed_per_question=0)
    optim = config.optim.model_copy(update={"lr": 2e-2})  # adapters start at B = 0: move them visibly in two steps
    config = config.model_copy(update={"steps": 2, "optim": optim, "lora": LoraConfig(rank=4, alpha=8.0)})
    before = max(loop_stack.services.rollout.versions())

    records = run_training(config, stack=loop_stack, show_progress=False)

    assert loop_stack.services.rollout.versions() == [records[-1].policy_version] == [before + 1 + 2]
    for record in records:  # a push of the base alone (or of stale weights) would show here from step 2 on
        assert record.rollout_mismatch_kl < 1e-3 and record.rollout_mismatch_outside_cap == 0.0
    start = load_file(str(loop_stack.model_dir / "model.safetensors"))
    final = load_file(str(tmp_path / "ckpt" / "step_2" / "hf" / "model.safetensors"))
    assert final.keys() == start.keys()
    changed = {k for k in start if not torch.equal(start[k], final[k])}
    assert changed and all(k.removesuffix(".weight").rsplit(".", 1)[-1] in LORA_TARGETS for k in changed)
    states = torch.load(tmp_path / "ckpt" / "step_2" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert states and all(".lora_A." in k or ".lora_B." in k for k in states)
