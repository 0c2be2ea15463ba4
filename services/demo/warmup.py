"""Supervised warm-up of the demo's tiny model on the arithmetic task, and pass@1 at T=1 on eval problems.

RL from a randomly initialised model learns nothing (no response is ever rewarded), so `rlep demo`
first fine-tunes the tiny model on worked solutions (`rlep.services.demo.task`) just long enough that it
solves some problems: RL then has both signal and room. `warmup` trains with plain torch (AdamW,
linear lr warm-up then cosine decay, gradient clipping, loss on the completion tokens only), saves an
HF checkpoint that vLLM and transformers load (weights + the tokenizer files of the source model),
and measures pass@1 by sampling one completion per eval problem at T=1, top-p 1, no top-k.

Every batch is freshly drawn from the train split, each problem with a random one of its valid
solution paths, so the policy starts out spreading its probability over all routes.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import Field

from rlep.common.config import StrictModel
from rlep.services.demo.task import (
    MAX_VALUE,
    TERMS,
    Problem,
    is_correct,
    make_problems,
    problem_messages,
    solution_paths,
)
from rlep.services.demo.tool_task import Segments, encode_segments, tool_trace
from rlep.services.learner.tool_rollouts import ToolLoopConfig

# What save_pretrained writes itself; every other file of the source checkpoint (tokenizer, chat
# template, model spec) is copied so the warmed-up directory is a complete checkpoint.
_WRITTEN_BY_SAVE = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"}
RESULT_FILE = "warmup.json"


class WarmupConfig(StrictModel):
    """Optimiser, data and evaluation settings of the supervised warm-up."""

    batch_size: int = Field(64, ge=1)
    """Sequences (problem + one worked solution) per optimiser step. With the tiny model, more and smaller
    steps win at a fixed compute budget: 64 reached ~4x the pass@1 of 128 on the same number of tokens."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate (AdamW), reached after `lr_warmup_steps`."""
    lr_warmup_steps: int = Field(30, ge=0)
    """Steps of linear lr warm-up from 0; then cosine decay to `min_lr_ratio * lr` at the last step."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    terms: int = Field(TERMS, ge=2)
    """Numbers per problem."""
    max_value: int = Field(MAX_VALUE, ge=1)
    """Numbers are drawn from [1, max_value]. 20 lets ~400 steps reach ~20% pass@1 at T=1; 99 stays near 1%."""
    eval_problems: int = Field(256, ge=0)
    """Held-out problems for pass@1 after training (0 skips the evaluation)."""
    eval_seed: int = 0
    """Seed of the eval problems: keep it fixed so every run is scored on the same set."""
    max_new_tokens: int = Field(40, ge=1)
    """Generation limit when evaluating (solutions of 2-digit sums are under 30 tokens)."""
    eval_batch_size: int = Field(256, ge=1)
    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads; None leaves torch's default (one per core)."""
    tool_share: float = Field(0.0, ge=0, le=1)
    """Share of examples written as a tool trace (`tool_task.tool_trace`, the tool's tokens out of the loss) instead
    of a worked solution: the tool demo's warm-up. Its pass@1 here samples without a tool, so set
    `eval_problems` to 0 with it and measure with tools in the RL run's first evaluation."""
    tool_loop: ToolLoopConfig = ToolLoopConfig()
    """The markers tool traces are written with: those of the runs that train on the warm-up model."""


@dataclass(frozen=True)
class WarmupResult:
    out_dir: Path
    steps: int
    losses: list[float]  # mean completion-token loss of each step
    pass_at_1: float | None  # None when eval_problems is 0
    eval_problems: int
    train_seconds: float
    eval_seconds: float
    tokens_per_second: float  # training throughput, prompt tokens included

    def to_json(self) -> dict:
        return {**asdict(self), "out_dir": str(self.out_dir)}


def encode_examples(
    tokenizer, problems: Sequence[Problem], completions: Sequence[str | Segments], loop: ToolLoopConfig | None = None
):
    """Right-padded `[N, L]` token ids and attention mask, and the `[N, L-1]` loss mask of completion tokens.

    `loss_mask[i, j]` is 1 where token j+1 of row i belongs to the completion (its EOS included) and was written by
    the policy, matching the next-token shift of the logits. A completion is a worked solution's text, or a tool
    trace's segments (`tool_task.encode_segments`, with `loop`'s markers): its tool tokens get 0.
    """
    from rlep.services.learner.batch import layout_rows  # torch: imported when a batch is built

    rows, masks = [], []
    for problem, completion in zip(problems, completions, strict=True):
        prompt = render_prompt(tokenizer, problem)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        segments = [("policy", completion)] if isinstance(completion, str) else completion
        completion_ids, mask = encode_segments(tokenizer, segments, loop)
        rows.append((prompt_ids, completion_ids))
        masks.append((len(prompt_ids), mask))
    tokens, attention, loss_mask = layout_rows(rows, tokenizer.pad_token_id)
    for i, (start, mask) in enumerate(masks):
        for k, kept in enumerate(mask):
            if not kept:  # token k of the completion is predicted at position start + k - 1
                loss_mask[i, start + k - 1] = 0.0
    return tokens, attention, loss_mask


def render_prompt(tokenizer, problem: Problem) -> str:
    return tokenizer.apply_chat_template(problem_messages(problem), add_generation_prompt=True, tokenize=False)


def completion_loss(model, tokens, attention, loss_mask):
    """Mean cross-entropy over the completion tokens of a batch (a scalar tensor)."""
    import torch.nn.functional as F

    logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    return (nll * loss_mask.reshape(-1)).sum() / loss_mask.sum().clamp(min=1)


def lr_at(step: int, total_steps: int, config: WarmupConfig) -> float:
    """Linear warm-up over `lr_warmup_steps`, then cosine decay to `min_lr_ratio * lr` at `total_steps`."""
    if step < config.lr_warmup_steps:
        return config.lr * (step + 1) / config.lr_warmup_steps
    span = max(total_steps - config.lr_warmup_steps, 1)
    progress = min((step - config.lr_warmup_steps) / span, 1.0)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_completions(
    model, tokenizer, problems: Sequence[Problem], max_new_tokens: int, batch_size: int = 256, temperature: float = 1.0
) -> list[str]:
    """One sampled completion per problem (T=`temperature`, no top-k/top-p), decoded up to EOS.

    Prompts are batched by token length so no row needs padding (the tiny model never saw pad tokens).
    """
    import torch

    encoded = [tokenizer.encode(render_prompt(tokenizer, p), add_special_tokens=False) for p in problems]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    texts = [""] * len(problems)
    model.eval()
    with torch.no_grad():
        for indices in by_length.values():
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                prompt = torch.tensor([encoded[i] for i in chunk])
                output = model.generate(
                    input_ids=prompt,
                    attention_mask=torch.ones_like(prompt),
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
                for i, row in zip(chunk, output[:, prompt.shape[1] :].tolist(), strict=True):
                    texts[i] = tokenizer.decode(row, skip_special_tokens=True)
    return texts


def pass_at_1(model, tokenizer, problems: Sequence[Problem], max_new_tokens: int, batch_size: int = 256) -> float:
    """Fraction of problems whose single T=1 sample boxes the right integer."""
    if not problems:
        return 0.0
    texts = sample_completions(model, tokenizer, problems, max_new_tokens, batch_size)
    return sum(is_correct(t, p) for t, p in zip(texts, problems, strict=True)) / len(problems)


def training_batch(step: int, seed: int, config: WarmupConfig) -> tuple[list[Problem], list[str | Segments]]:
    """The problems of one step and a random valid solution of each, a `tool_share` of them tool traces;
    deterministic in (seed, step). Without tool traces the draws are the ones this function always made."""
    import random

    problems = make_problems(
        config.batch_size, seed=seed * 1_000_003 + step, split="train", terms=config.terms, max_value=config.max_value
    )
    rng = random.Random(f"warmup-paths:{seed}:{step}")
    completions: list[str | Segments] = [rng.choice(solution_paths(p)) for p in problems]
    if config.tool_share > 0:
        tools = random.Random(f"warmup-tools:{seed}:{step}")
        for i, problem in enumerate(problems):
            if tools.random() < config.tool_share:
                completions[i] = tool_trace(problem, config.tool_loop)
    return problems, completions


def save_checkpoint(model, source_dir: Path, out_dir: Path) -> None:
    """HF weights + config, plus the source checkpoint's tokenizer files (what vLLM needs to load it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for path in source_dir.iterdir():
        if path.is_file() and path.name not in _WRITTEN_BY_SAVE and path.name != RESULT_FILE:
            shutil.copy2(path, out_dir / path.name)


def train_steps(
    model, tokenizer, steps: int, seed: int, config: WarmupConfig, progress: bool
) -> tuple[list[float], int]:
    """Runs the supervised steps in place on `model`; returns each step's loss and the tokens trained on."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    decay = [p for p in model.parameters() if p.ndim >= 2]  # no weight decay on norms and biases
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=config.betas,
    )
    losses: list[float] = []
    tokens_seen = 0
    columns = [
        TextColumn("warm-up"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    ]
    started = time.perf_counter()
    model.train()
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("warm-up", total=steps, info="")
        for step in range(steps):
            tokens, attention, loss_mask = encode_examples(
                tokenizer, *training_batch(step, seed, config), loop=config.tool_loop
            )
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps, config)
            loss = completion_loss(model, tokens, attention, loss_mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            losses.append(loss.item())
            tokens_seen += int(attention.sum())
            rate = tokens_seen / (time.perf_counter() - started)
            info = f"loss {losses[-1]:.3f}  lr {optimizer.param_groups[0]['lr']:.1e}  {rate:,.0f} tok/s"
            bar.update(task, advance=1, info=info)
    return losses, tokens_seen


def warmup(
    model_dir: Path | str,
    out_dir: Path | str,
    steps: int,
    seed: int = 0,
    config: WarmupConfig | None = None,
    progress: bool = True,
) -> WarmupResult:
    """Fine-tunes the checkpoint in `model_dir` for `steps` steps, saves it to `out_dir`, measures pass@1.

    Deterministic in (`model_dir`, `steps`, `seed`, `config`). Also writes `warmup.json` (the result,
    the seed and the config) into `out_dir`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = config or WarmupConfig()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    started = time.perf_counter()
    losses, tokens_seen = train_steps(model, tokenizer, steps, seed, config, progress)
    train_seconds = time.perf_counter() - started
    save_checkpoint(model, model_dir, out_dir)

    started = time.perf_counter()
    score = None
    if config.eval_problems:
        problems = make_problems(
            config.eval_problems, seed=config.eval_seed, split="eval", terms=config.terms, max_value=config.max_value
        )
        score = pass_at_1(model, tokenizer, problems, config.max_new_tokens, config.eval_batch_size)
    result = WarmupResult(
        out_dir=out_dir,
        steps=steps,
        losses=losses,
        pass_at_1=score,
        eval_problems=config.eval_problems,
        train_seconds=train_seconds,
        eval_seconds=time.perf_counter() - started,
        tokens_per_second=tokens_seen / max(train_seconds, 1e-9),
    )
    (out_dir / RESULT_FILE).write_text(json.dumps({**result.to_json(), "seed": seed, "config": config.model_dump()}))
    return result
