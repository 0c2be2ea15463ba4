"""What the closed-loop tests share: a verl-schema file of sums, their training config, a seeded replay pool, and
rollouts that rewrite samples so an untrained tiny model gives the verifier successes and wrong answers."""

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


class AnsweringRollout:
    """The stack's real rollout, counted, with two samples per question rewritten: sample 0 gives the right sum
    (`\\boxed{a+b}`) and sample 1 a wrong one. The untrained tiny model never writes a parseable answer, so
    without this the verifier would have no success to find and no WRONG verdict to give."""

    def __init__(self, rollout):
        self.rollout, self.calls = rollout, 0

    def max_model_len(self) -> int:
        return self.rollout.max_model_len()

    def generate(self, prompts, sampling):
        from dataclasses import replace

        self.calls += 1
        completions = self.rollout.generate(prompts, sampling)
        for prompt, completion in zip(prompts, completions, strict=True):
            a, b = (int(x) for x in prompt[-1]["content"].removesuffix("=?").split("+"))
            right, wrong = f"\\boxed{{{a + b}}}", f"\\boxed{{{a + b + 1}}}"
            completion.samples[0] = replace(completion.samples[0], text=right)
            completion.samples[1] = replace(completion.samples[1], text=wrong)
        return completions


class WellFormedEquation:
    """The stack's real rollout with sample 0 of every question rewritten to an equation of numbers no countdown
    question draws (they are 1-99): countdown scores it FORMAT_SCORE (a wrong equation), math-verify -1. The untrained
    tiny model writes no `<answer>` tags, so its own samples score countdown's 0."""

    TEXT = "<think> none </think> <answer> 0 + 0 </answer>"

    def __init__(self, rollout):
        self._rollout = rollout

    def __getattr__(self, name):
        return getattr(self._rollout, name)

    def generate(self, prompts, sampling):
        from dataclasses import replace

        completions = self._rollout.generate(prompts, sampling)
        for completion in completions:
            completion.samples[0] = replace(completion.samples[0], text=self.TEXT)
        return completions
