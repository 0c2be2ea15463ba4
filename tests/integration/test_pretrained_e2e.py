"""A real pretrained model end to end on CPU: SmolLM2-135M-Instruct (BPE, 49k vocabulary, chat template).

The newcomer's path (issues 11 and 32), in miniature and with no config file written by hand: the model converted
by `rlep model import` (the `smollm2_dir` fixture runs the command) and served by the rollout service; RLEP's
released pool format (text-only candidates, `data_source: dapo_math`) imported with `rlep pool import`;
`rlep train --model … --data … --pool … --steps 2` on DAPO-17k rows (`data_source: DAPO-17k`) against those
services, sized by `--set`; `rlep collect` from the trained checkpoint; `rlep eval … --samples` through an eval
service sampling from the trained policy.
"""

from __future__ import annotations

import json
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlep.common.config import ServerConfig
from rlep.services.cli.app import app
from rlep.services.learner.records import read_step_log
from tests.conftest import TEST_DATA

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTIONS, G, M = 2, 2, 2
MAX_RESPONSE = 48


def candidate_texts(truth: str) -> list[str]:
    """Three distinct verified-correct answers, as a converged policy would write them."""
    return [
        f"Working through the problem step by step gives {truth}.\n\nAnswer: $\\boxed{{{truth}}}$",
        f"The final answer is $\\boxed{{{truth}}}$.",
        f"So the result is {truth}, i.e. $\\boxed{{{truth}}}$",
    ]


@pytest.fixture(scope="module")
def dapo_rows() -> list[dict]:
    return pq.read_table(TEST_DATA / "dapo_math_17k.parquet").slice(0, QUESTIONS).to_pylist()


@pytest.fixture(scope="module")
def smollm2_rollout(smollm2_dir, auth_token_file):
    """The converted model behind a real rollout server (vLLM CPU build), with a bearer token."""
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.main import start_rollout

    engine = {"model": str(smollm2_dir), "max_model_len": 1024, "max_num_seqs": 16, "enforce_eager": True}
    config = RolloutConfig(server=ServerConfig(port=0, metrics_port=0, auth_token_file=auth_token_file), engine=engine)
    running = start_rollout(config)
    yield f"127.0.0.1:{running.port}"
    running.stop()


def as_sets(config: dict, prefix: str = "") -> list[str]:
    """`--set key.path=value` flags for every leaf of `config` (lists as JSON, which the YAML parser reads)."""
    flags = []
    for key, value in config.items():
        if isinstance(value, dict):
            flags += as_sets(value, f"{prefix}{key}.")
        else:
            flags += ["--set", f"{prefix}{key}={json.dumps(value) if isinstance(value, list) else value}"]
    return flags


def run_cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def evaluate_with_samples(rollout: str, verifier, redis_url: str, auth_token_file, tmp_path) -> list[dict]:
    """`rlep eval --samples` through an eval service over the trained replicas: the responses, read back."""
    from rlep.services.eval.config import EvalConfig
    from rlep.services.eval.main import start_eval

    token = {"auth_token_file": str(auth_token_file)}
    config = EvalConfig.model_validate(
        {
            "server": {"port": 0, **token},
            "redis_url": redis_url,
            "key_prefix": f"rlep:eval:e2e-{uuid.uuid4().hex[:8]}:",
            "rollout": {"addresses": [rollout], **token},
            "verifier": {"address": f"127.0.0.1:{verifier.port}", **token},
        }
    )
    running = start_eval(config)
    out = tmp_path / "eval-samples.jsonl"
    try:
        shown = run_cli(
            "eval", "--server", running.url, "--auth-token-file", str(auth_token_file), "--model", "current",
            "--datasets", "gsm8k:2", "--n", "2", "--max-tokens", "32", "--samples", str(out),
        )  # fmt: skip
    finally:
        running.stop()
    assert "truncated" in shown
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_rlep_on_a_released_pool_with_a_pretrained_model(
    ray_local,
    smollm2_dir,
    smollm2_rollout,
    verifier,
    replay,
    replay_client,
    redis_url,
    auth_token_file,
    dapo_rows,
    tmp_path,
):
    from rlep.common.types import Verdict
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.cursor import DataCursor, load_questions
    from rlep.services.learner.scored_trajectories import ReplayReport
    from rlep.services.learner.step_inputs import Gathered, ServiceClients, StepInputs, StepTimer
    from rlep.services.learner.tokens import PolicyTokenizer
    from rlep.services.rollout.client import RolloutClient

    pool = f"pretrained-{uuid.uuid4().hex[:12]}"  # the CI Redis outlives test runs
    train_file = tmp_path / "dapo17k.parquet"
    pq.write_table(pa.Table.from_pylist(dapo_rows), train_file)
    released = [
        {
            "data_source": "dapo_math",  # RLEP's label for the rows DAPO-17k calls `DAPO-17k`
            "prompt": row["prompt"],
            "ability": "MATH",
            "reward_model": {
                "ground_truth": row["reward_model"]["ground_truth"],
                "style": "rule-lighteval/MATH_v2",
                "candidates": candidate_texts(row["reward_model"]["ground_truth"]),
            },
            "extra_info": {"index": str(i)},
        }
        for i, row in enumerate(dapo_rows)
    ]
    pool_file = tmp_path / "released-pool.parquet"
    pq.write_table(pa.Table.from_pylist(released), pool_file)
    token = ["--auth-token-file", str(auth_token_file)]
    replay_address = f"127.0.0.1:{replay.port}"
    assert "added 6," in run_cli("pool", "import", str(pool_file), "--pool", pool, "-a", replay_address, *token)

    config = {
        "run_id": "smollm2-e2e",
        "model": str(smollm2_dir),
        "seed": 1,
        "steps": 2,
        "replay_pool": pool,
        "algorithm": {
            "questions_per_step": QUESTIONS,
            "fresh_per_question": G,
            "replayed_per_question": M,
            "max_response_tokens": MAX_RESPONSE,
            "overlong_buffer_tokens": 16,
            # 2 x G = 4 rows per optimizer step: 2 updates per step with M=2. On CPU each AdamW step over 135M
            # parameters costs seconds (4 a step took 40 of this test's 114 s alone).
            "mini_batch_questions": 2,
            "require_replay": True,
        },
        "optim": {"lr": 1e-5, "warmup_steps": 0, "micro_batch_size": 4},
        "deepspeed": {"zero_stage": 2},
        "data": {"train_files": [str(train_file)], "shuffle": False},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 2, "keep_last": 1},
        "endpoints": {
            "rollout": [smollm2_rollout],
            "verifier": f"127.0.0.1:{verifier.port}",
            "replay": replay_address,
            "auth_token_file": str(auth_token_file),
        },
        "local": {"learner_cpus": 1.0},
    }
    named = {"model": str(smollm2_dir), "data": str(train_file), "pool": pool, "steps": "2"}
    sizes = as_sets({k: v for k, v in config.items() if k not in ("model", "data", "replay_pool", "steps")})
    started = time.perf_counter()
    run_cli("train", *[a for name, value in named.items() for a in (f"--{name}", value)], *sizes)
    train_seconds = time.perf_counter() - started

    records = read_step_log(tmp_path / "ckpt" / "log.jsonl")
    assert [r.step for r in records] == [1, 2]
    for r in records:
        # Every question has >= M text-only candidates: all of them reach the batch, re-tokenised.
        assert r.replayed_fraction == pytest.approx(M / (G + M))
        assert (r.replay_requested, r.replay_used, r.replay_retokenized) == (QUESTIONS * M,) * 3
        assert r.replay_dropped == {} and r.replay_failed_verification == 0
    # A bfloat16 replica (vLLM's `auto` for this float32 checkpoint) beside the float32 learner: a measured gap.
    assert all(r.rollout_mismatch_kl > 0 and r.rollout_mismatch_ratio_max > 1 for r in records)
    print(f"\nSmolLM2-135M, bfloat16 replica vs float32 learner: mismatch KL "
          f"{[f'{r.rollout_mismatch_kl:.2e}' for r in records]}, ratio max "
          f"{[round(r.rollout_mismatch_ratio_max, 3) for r in records]}")  # fmt: skip
    # 2 x (G + M) = 8 rows per step in mini-batches of 2 x G = 4 rows: 2 optimizer steps per step, counted on.
    assert [r.optimizer_steps for r in records] == [2.0, 4.0]
    # The replicas serve the learner's final weights.
    rollout = RolloutClient([smollm2_rollout], token=auth_token_file.read_text().strip(), timeout_s=300)
    assert rollout.versions() == [records[-1].policy_version]
    # The weights moved.
    from safetensors.torch import load_file

    start = load_file(str(smollm2_dir / "model.safetensors"))
    final = load_file(str(tmp_path / "ckpt" / "step_2" / "hf" / "model.safetensors"))
    assert sum(not (start[k] == final[k]).all() for k in start) > len(start) // 2

    # The replayed rows, as the learner lays them out, are the chat-templated question and the candidate text.
    tokenizer = PolicyTokenizer.load(smollm2_dir, 1024, MAX_RESPONSE)
    questions = load_questions([train_file])
    # Stored rewards, no verifier: this checks the layout only (training re-verified them, as the records show).
    algorithm = {**config["algorithm"], "reverify_replayed": False}
    train_config = TrainConfig.model_validate({**config, "endpoints": {}, "algorithm": algorithm})
    services = ServiceClients(rollout, None, replay_client)
    inputs = StepInputs(train_config, questions, DataCursor(len(questions), 0, False), services, tokenizer)
    gathered = Gathered(questions, [tokenizer.encode_prompt(q.chat()) for q in questions], [[] for _ in questions])
    report = ReplayReport()
    replayed = inputs.replayed(0, gathered, report, StepTimer())
    hf = tokenizer.tokenizer
    for question, row in zip(questions, dapo_rows, strict=True):
        rendered = hf.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        texts = candidate_texts(row["reward_model"]["ground_truth"])
        assert len(replayed[question.question_id]) == M
        for t in replayed[question.question_id]:
            assert t.response_token_ids[-1] == hf.eos_token_id
            assert hf.decode(t.prompt_token_ids) == rendered
            assert hf.decode(t.response_token_ids[:-1]) in texts
            assert t.verdict == Verdict.CORRECT

    # Phase 1 from the trained checkpoint: its chat template survived the save.
    checkpoint = tmp_path / "ckpt" / "step_2" / "hf"
    assert (checkpoint / "chat_template.jinja").exists() or "chat_template" in (
        checkpoint / "tokenizer_config.json"
    ).read_text()
    run_cli(
        "collect", "--model", str(checkpoint), "--data", str(train_file), "--pool", f"{pool}-collect",
        "--n", "2", "--max-tokens", "32", "--min-successes", "1", *sizes,
        "--state-file", str(tmp_path / "collect-state.json"),
    )  # fmt: skip
    assert json.loads((tmp_path / "collect-state.json").read_text())["questions"] == QUESTIONS
    eval_samples = evaluate_with_samples(smollm2_rollout, verifier, redis_url, auth_token_file, tmp_path)
    assert len(eval_samples) == 4  # 2 questions x n=2, each with what a person needs to see why it scored so
    assert all(s["verdict"] in {v.value for v in Verdict} and "extracted_answer" in s for s in eval_samples)
    print(f"\nSmolLM2-135M: rlep train, 2 RLEP steps: {train_seconds:.0f} s in all; step seconds "
          f"{[round(r.step_seconds, 1) for r in records]}")  # fmt: skip
    rollout.close()
    for name in (pool, f"{pool}-collect"):
        if name in replay_client.list_pools():
            replay_client.drop(name, confirm=name)
