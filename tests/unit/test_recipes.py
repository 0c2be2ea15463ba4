"""configs/recipes/ reproduce the paper's Table 1 runs: every value checked against the paper's numbers here.

The numbers are written out below on purpose, not read from any config: RLEP (arXiv 2507.07451),
Qwen2.5-Math-7B on DAPO-Math-17k, built on DAPO's verl recipe. Shared by every run: 512 prompts per
step, 16 samples each at T=1.0 / top-p 1.0, prompt <= 1024 tokens (left-truncated), response <= 3072
with a 512-token overlong buffer, lr 1e-6 with 10 warm-up steps, weight decay 0.1, clip 0.2 / 0.28,
dual-clip 10, token-mean loss. Rows differ in dynamic sampling, PPO mini-batch and M; collection
samples 64 answers at T=0.7 / top-p 0.95 and keeps questions with >= 2 successes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlep.common.config import load_config
from rlep.services.cli.app import app
from rlep.services.learner.config import TrainConfig

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "recipes"

SHARED = {
    "algorithm.questions_per_step": 512,
    "algorithm.fresh_per_question": 16,
    "algorithm.temperature": 1.0,
    "algorithm.top_p": 1.0,
    "algorithm.max_response_tokens": 3072,
    "algorithm.overlong_buffer_tokens": 512,
    "algorithm.overlong_penalty": 1.0,
    "algorithm.ppo_epochs": 1,
    "algorithm.clip_low": 0.2,
    "algorithm.clip_high": 0.28,
    "algorithm.clip_c": 10.0,
    "algorithm.loss_agg": "token-mean",
    "data.max_prompt_tokens": 1024,
    "optim.lr": 1e-6,
    "optim.warmup_steps": 10,
    "optim.weight_decay": 0.1,
    "optim.grad_clip": 1.0,
}
PAPER = {
    "dapo": {
        **SHARED,
        "algorithm.replayed_per_question": 0,
        "algorithm.mini_batch_questions": 32,
        "algorithm.dynamic_sampling.enabled": True,
        "algorithm.dynamic_sampling.questions_per_round": 1536,
        "algorithm.dynamic_sampling.max_rounds": 10,
        "algorithm.dynamic_sampling.metric": "acc",
    },
    "dapo_nodyn_bs32": {
        **SHARED,
        "algorithm.replayed_per_question": 0,
        "algorithm.mini_batch_questions": 32,
        "algorithm.dynamic_sampling.enabled": False,
    },
    "dapo_nodyn_bs64": {
        **SHARED,
        "algorithm.replayed_per_question": 0,
        "algorithm.mini_batch_questions": 64,
        "algorithm.dynamic_sampling.enabled": False,
    },
    "rlep": {
        **SHARED,
        "algorithm.replayed_per_question": 2,
        "algorithm.mini_batch_questions": 64,
        "algorithm.dynamic_sampling.enabled": False,
        "algorithm.reverify_replayed": True,
    },
    "collect": {
        "collect.samples_per_question": 64,
        "collect.temperature": 0.7,
        "collect.top_p": 0.95,
        "collect.max_response_tokens": 3072,
        "collect.min_successes": 2,
        "data.max_prompt_tokens": 1024,
    },
}


def value_at(config: TrainConfig, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def test_every_recipe_is_in_the_table():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(PAPER)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipe_matches_the_paper(name):
    config = load_config(TrainConfig, RECIPES / f"{name}.yaml")
    wrong = {k: (value_at(config, k), v) for k, v in PAPER[name].items() if value_at(config, k) != v}
    assert not wrong, f"{name}.yaml differs from the paper (got, paper): {wrong}"


def test_rlep_collects_from_the_bs64_baseline_into_the_pool_it_reads():
    rlep = load_config(TrainConfig, RECIPES / "rlep.yaml")
    baseline = load_config(TrainConfig, RECIPES / "dapo_nodyn_bs64.yaml")
    collect = load_config(TrainConfig, RECIPES / "collect.yaml")
    assert collect.replay_pool == rlep.replay_pool
    assert Path(collect.model).parts[:2] == (str(baseline.checkpoint.dir.parent), baseline.checkpoint.dir.name)
    assert f"step_{baseline.steps}" in collect.model
    assert rlep.model == baseline.model  # RLEP restarts from the base model, not from the baseline


def test_code_defaults_are_the_rlep_recipe():
    """config.py's docstring says its defaults are the recipe: the algorithm, data and optimizer parts are."""
    defaults = TrainConfig()
    wrong = {k: (value_at(defaults, k), v) for k, v in PAPER["rlep"].items() if value_at(defaults, k) != v}
    assert not wrong, f"TrainConfig defaults differ from the RLEP recipe (got, paper): {wrong}"


def test_dry_run_shows_the_recipe():
    result = CliRunner().invoke(
        app, ["train", "--config", str(RECIPES / "rlep.yaml"), "--dry-run", "--skip-path-checks"]
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["algorithm"]["replayed_per_question"] == 2
    assert shown["algorithm"]["mini_batch_questions"] == 64
    assert shown["data"]["max_prompt_tokens"] == 1024
