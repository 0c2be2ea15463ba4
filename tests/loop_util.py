"""What the closed-loop tests share: a verl-schema file of sums, their training config, a seeded replay pool."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlep.common.dataset import question_id
from rlep.common.types import Trajectory, Verdict

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
    from rlep.services.learner.config import TrainConfig

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
