"""The protocol's settings (`ProtocolConfig`, whose defaults ARE the protocol), its ablation cells, and the
TrainConfig of each of its runs. Paths are relative to the working directory: run it from the repository's root,
where the archive is."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rlep.common.config import StrictModel, deep_merge
from rlep.services.learner.config import TrainConfig

# Every ablation cell: RLEP with these TrainConfig.algorithm values (and a pool) for `ablation_seeds` seeds.
# `pool`: "phase1" (the protocol's), "phase1-distinct" (collected with >= 2 distinct), "phase1-half" (collected
# from the first baseline's checkpoint at half its steps), "copy" (a per-run
# copy of phase1, since online replay writes to it), "fresh-copy" (a per-run copy of phase1's successes without the
# question histories that earlier runs reported into it: a rule that reads history starts from none), "empty" (a
# per-run empty pool).
# In the order they run: the ones that decide a user's defaults (M, online replay) first.
ABLATIONS: dict[str, dict[str, Any]] = {
    "M=1": {"algorithm": {"replayed_per_question": 1}},
    "M=4": {"algorithm": {"replayed_per_question": 4}},
    "online replay + phase-1 pool": {"algorithm": {"online_replay": True}, "pool": "copy"},
    "online replay, no phase-1 pool": {"algorithm": {"online_replay": True}, "pool": "empty"},
    "strategy=diverse": {"algorithm": {"replay_strategy": "diverse"}},
    "strategy=recency": {"algorithm": {"replay_strategy": "recency"}},
    "strategy=prioritized": {"algorithm": {"replay_strategy": "prioritized"}},
    "collect rule >= 2 distinct": {"pool": "phase1-distinct"},
    "pool from the half-trained policy": {"pool": "phase1-half"},
    # Issue 48: whether a group gets replay at all (services/learner/replay_rules.py; `band` at its defaults, pass
    # rates in [0, 0.5]: the questions the policy still fails more often than not), each on its own pool copy
    # (the history it reports and `band` reads is per pool: runs sharing one would read each other's).
    "rule=rescue": {"algorithm": {"replay_rule": {"when": "rescue"}}, "pool": "fresh-copy"},
    "rule=band": {"algorithm": {"replay_rule": {"when": "band"}}, "pool": "fresh-copy"},
}
# The cells issue 29 asks for (>= 3 seeds each): how many replayed rows, how strong the pool's policy, which draw.
ISSUE_CELLS = ["M=1", "M=4", "pool from the half-trained policy", "strategy=diverse"]
NOT_RUNNABLE = {
    "replay failures too": "the replay service keeps CORRECT trajectories only (services/replay/server.py rejects "
    "others), collect() stores successes only, and the learner re-verifies replayed rows expecting successes",
}


class ProtocolConfig(StrictModel):
    """Sizes and rules of the protocol; `--set key=value` overrides one (e.g. `--set seeds=[0,1]`)."""

    seeds: list[int] = Field([0, 1, 2, 3, 4], min_length=1)
    """RL seeds; both arms run each. The first one's baseline is collected from."""
    work_dir: Path = Path("runs/rlep-protocol")
    """Checkpoints, step logs and per-run results (reused on a rerun)."""
    results: Path = Path("experiments/protocol/results/issue29")
    """Prefix of the JSON and PNG written (`.json`, `.png`). The defaults are issue 29's protocol, so its report is
    the default: `issue15.*` holds issue 15's figures, which a run of today's defaults must not overwrite."""
    archive: Path | None = Path("experiments/protocol/results/archive")
    """Finished runs and the checkpoints the rest starts from, kept in the repository (None: not kept)."""
    terms: int = Field(3, ge=2)
    """Numbers per problem. Issue 29's task (`pilots`): sums of 3 numbers in [1, 50], 3 valid
    solution paths per question; its warm-up starts near 0.21 and plain RL converges near 0.53 (the pilot of the
    issue-15 task, 4 numbers in [1, 16], started at 0.37 and converged near 0.52)."""
    max_value: int = Field(50, ge=2)
    """Numbers in [1, max_value]: 50^3 = 125,000 problems, room for 2,500 held-out eval questions."""
    warmup_steps: int = Field(600, ge=0)
    warmup_seed: int = 0
    train_questions: int = Field(256, ge=8)
    """Training problems: small enough that each is seen several times and the pool covers most of them."""
    eval_questions: int = Field(2500, ge=8)
    eval_samples: int = Field(1, ge=1)
    eval_every: int = Field(20, ge=1)
    """An evaluation (2,500 generations) costs about as much as 10 training steps on 2 cores: every 20 steps keeps
    five seeds of both arms within ~2 h (every 10 would take ~3 h)."""
    questions_per_step: int = Field(16, ge=1)
    mini_batch_questions: int = Field(4, ge=1)
    """PPO mini-batch: questions_per_step / this = optimizer updates per step (4 here, 8 in the paper)."""
    fresh_per_question: int = Field(8, ge=2)
    replayed_per_question: int = Field(2, ge=1)
    lr: float = Field(3e-5, gt=0)
    """With 4 mini-batch updates per step, 1e-4 (the demo's, 1 update) made the baseline fall 0.40 -> 0.34 in 10 steps
    and stay there to step 40; 3e-5 dipped to 0.37 and rose to 0.425 by step 40 (seed 0, 400 eval questions)."""
    max_response_tokens: int = Field(48, ge=8)
    max_steps: int = Field(600, ge=1)
    """The horizon: every run of every arm trains this many steps (`horizon: fixed`); under `horizon: plateau`, the
    baseline's cap (a capped run is reported as not converged)."""
    horizon: Literal["fixed", "plateau"] = "fixed"
    """`fixed` (issue 49): every baseline runs `max_steps`, so no arm's length depends on its noise. `plateau`
    (issues 15 and 29, kept to reproduce their runs): a baseline stops at the plateau rule below, and its seed's
    other arms run as many steps."""
    patience: int = Field(5, ge=1)
    """`horizon: plateau`: evaluations without a new best that count as converged (5 x 20 = 100 steps)."""
    min_delta: float = Field(0.01, ge=0)
    """`horizon: plateau`: a new best must beat the old by more than this (one standard error of an evaluation)."""
    pair_on_other_cpu: bool = False
    """An arm whose seed's baseline ran on another CPU model (or core count) is refused before it starts: the CPU
    changes trajectories (issue 49). True trains it anyway; the report then lists that pair unpaired."""
    equal_updates_arm: bool = True
    """Also run RLEP with as many optimizer updates per step as the baseline (mini-batches over G + M rows)."""
    collect_samples: int = Field(64, ge=2)
    collect_rule: Literal["correct", "distinct"] = "correct"
    """Keep questions with >= 2 correct samples (the paper) or >= 2 distinct correct texts."""
    ablation_seeds: int = Field(3, ge=1)
    """Seeds per ablation cell (the first ones of `seeds`); a cell of one seed is no finding."""
    ablation_cells: list[str] | None = ISSUE_CELLS
    """The cells to run (names of ABLATIONS); None = all. Cells left out are reported as not run."""
    train: dict[str, Any] = {}
    """TrainConfig values every run shares beyond the above (default: configs/demo.yaml's `train`)."""

    @model_validator(mode="after")
    def _evaluated_at_cap(self) -> ProtocolConfig:
        if unknown := set(self.ablation_cells or []) - set(ABLATIONS):
            raise ValueError(f"unknown ablation cells {sorted(unknown)}; choose from {sorted(ABLATIONS)}")
        if self.max_steps % self.eval_every:
            raise ValueError("max_steps must be a multiple of eval_every (a run stops at an evaluation)")
        if self.questions_per_step % self.mini_batch_questions:
            raise ValueError("questions_per_step must be a multiple of mini_batch_questions")
        return self


def demo_train_settings() -> dict[str, Any]:
    from rlep.services.demo.runner import load_demo_config

    return load_demo_config().train.model_dump(exclude_unset=True)


def run_config(
    cfg: ProtocolConfig, run_id: str, seed: int, steps: int, model: Path, pool: str, extra: dict
) -> TrainConfig:
    """The TrainConfig of one run: the protocol's sizes over the shared settings, then `extra` (an ablation).
    The first seed's baseline keeps a checkpoint at every evaluation: the half-trained pool comes from one."""
    work = cfg.work_dir / run_id
    keep_all = run_id == f"baseline-s{cfg.seeds[0]}"
    checkpoint = {"every_steps": cfg.eval_every, "keep_last": cfg.max_steps // cfg.eval_every} if keep_all else {}
    run = {
        "run_id": run_id,
        "model": str(model),
        "seed": seed,
        "steps": steps,
        "replay_pool": pool,
        "algorithm": {
            "questions_per_step": cfg.questions_per_step,
            "fresh_per_question": cfg.fresh_per_question,
            "replayed_per_question": 0 if run_id.startswith("baseline") else cfg.replayed_per_question,
            "max_response_tokens": cfg.max_response_tokens,
            "mini_batch_questions": cfg.mini_batch_questions,
        },
        "optim": {"lr": cfg.lr},
        "checkpoint": {"dir": str(work), "every_steps": steps, "keep_last": 1, **checkpoint},
        "log_file": str(work / "log.jsonl"),
        "data": {"train_files": [str(cfg.work_dir / "train.parquet")]},
        "eval": {
            "every_steps": cfg.eval_every,
            "files": [str(cfg.work_dir / "eval.parquet")],
            "samples_per_question": cfg.eval_samples,
            "max_questions": cfg.eval_questions,
        },
    }
    settings = deep_merge(deep_merge(cfg.train or demo_train_settings(), run), extra)
    return TrainConfig.model_validate(settings)


def half_step(cfg: ProtocolConfig, steps: int) -> int:
    """Where the first baseline's half-way checkpoint is: half its steps, rounded down to an evaluation."""
    return max(cfg.eval_every, steps // 2 // cfg.eval_every * cfg.eval_every)


def ablation_run_id(cell: str, seed: int) -> str:
    return "abl-" + "".join(c if c.isalnum() else "-" for c in cell) + f"-s{seed}"
