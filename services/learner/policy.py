"""The trained policy on DeepSpeed: logprobs of a batch, PPO updates with DAPO's loss, weights, checkpoints.

One `PolicyTrainer` per learner process. On this CPU machine kind DeepSpeed runs its CPU
accelerator over gloo (1 or more processes); on GPUs the same code runs over NCCL. ZeRO stage,
dtype, optimizer, warm-up and clipping come from the run's config.

Gradient accumulation is driven by hand: every micro-batch's loss is normalised by the token count
of the whole mini-batch (`policy_loss(normalizer=...)`), DeepSpeed is told where the mini-batch
ends (`set_gradient_accumulation_boundary`), so one optimizer step sees exactly the mini-batch's
gradient however it was split.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from rlep_common.algorithm import policy_loss
from services.learner.batch import ExperienceBatch, micro_batches, mini_batches, token_entropy, token_logprobs
from services.learner.config import TrainConfig
from services.rollout.nccl import BroadcastGroup, NcclWeightSender, manifest
from services.rollout.weights import TensorInfo

log = logging.getLogger(__name__)


def deepspeed_config(config: TrainConfig, world_size: int) -> dict[str, Any]:
    optim, ds = config.optim, config.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # really partition small models too
    if ds.offload_optimizer and ds.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    config_dict: dict[str, Any] = {
        # Boundaries are set by hand per mini-batch; DeepSpeed's own count only has to be consistent.
        "train_micro_batch_size_per_gpu": optim.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": optim.micro_batch_size * world_size,
        "gradient_clipping": optim.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optim.lr,
                "betas": list(optim.betas),
                "weight_decay": optim.weight_decay,
                "torch_adam": True,  # DeepSpeed's fused CPU Adam needs a ~6 min JIT build
            },
        },
        "bf16": {"enabled": ds.dtype == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if optim.warmup_steps > 0:
        # WarmupLR gives optimizer step k the lr `lr * k / warmup_steps` (step 0 at 0, as HF's schedule);
        # with no warm-up there is no scheduler at all, so even the first step gets the full lr.
        config_dict["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": optim.lr,
                "warmup_num_steps": optim.warmup_steps,
                "warmup_type": "linear",
            },
        }
    return config_dict


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    import deepspeed

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


class PolicyTrainer:
    def __init__(self, model_dir: Path, config: TrainConfig, rank: int = 0, world_size: int = 1):
        import deepspeed
        from transformers import AutoModelForCausalLM

        torch.manual_seed(config.seed)
        self.config, self.rank, self.world_size = config, rank, world_size
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tied = bool(model.config.tie_word_embeddings)
        # Pushed weights must match the checkpoint the rollout workers loaded, dtype included.
        self.checkpoint_dtype = getattr(model.config, "dtype", None) or torch.float32
        if isinstance(self.checkpoint_dtype, str):
            self.checkpoint_dtype = getattr(torch, self.checkpoint_dtype)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters()], config=deepspeed_config(config, world_size)
        )
        self.shuffle = torch.Generator().manual_seed(config.seed + 1)
        self.optimizer_steps = 0
        self._sender: NcclWeightSender | None = None  # GPU weight broadcast, created on first use

    # -- forward passes ----------------------------------------------------------------------
    def _forward(self, batch: ExperienceBatch) -> torch.Tensor:
        return self.engine(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits

    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """`[N, L-1]` logprobs of every next token under the current weights (masked positions included)."""
        self.engine.eval()
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        for rows in micro_batches(torch.arange(batch.size), self.config.optim.micro_batch_size):
            sub = batch.select(rows)
            out[rows, : sub.loss_mask.shape[1]] = token_logprobs(self._forward(sub), sub.tokens)
        return out

    # -- update ------------------------------------------------------------------------------
    def update(self, batch: ExperienceBatch, rows_per_mini_batch: int) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches of `batch` (which must carry old_logprobs)."""
        if batch.old_logprobs is None:
            raise ValueError("old logprobs must be computed before the update")
        algo = self.config.algorithm
        self.engine.train()
        sums = {"loss": 0.0, "clip_frac": 0.0, "clip_frac_lower": 0.0, "approx_kl": 0.0, "entropy": 0.0}
        tokens_seen = 0.0
        count = max(1, round(batch.size / rows_per_mini_batch))
        for _ in range(algo.ppo_epochs):
            for mini in mini_batches(batch.size, count, self.shuffle):
                # Every process takes every world_size-th row; DeepSpeed averages gradients over
                # processes, so each normalises by its share of the mini-batch's token count.
                normalizer = (float(batch.loss_mask[mini].sum().item()) or 1.0) / self.world_size
                micros = self._my_micro_batches(mini)
                for i, (rows, weight_scale) in enumerate(micros):
                    sub = batch.select(rows)
                    logits = self._forward(sub)
                    new = token_logprobs(logits, sub.tokens)
                    loss, stats = policy_loss(
                        new,
                        sub.old_logprobs,
                        sub.advantages,
                        sub.loss_mask,
                        clip_low=algo.clip_low,
                        clip_high=algo.clip_high,
                        clip_c=algo.clip_c,
                        agg=algo.loss_agg,
                        normalizer=normalizer if algo.loss_agg == "token-mean" else None,
                    )
                    self.engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
                    self.engine.backward(loss * weight_scale, scale_wrt_gas=False)
                    self.engine.step()
                    weight = float(sub.loss_mask.sum().item()) * weight_scale
                    tokens_seen += weight
                    sums["loss"] += loss.item() * normalizer * weight_scale
                    for key in ("clip_frac", "clip_frac_lower", "approx_kl"):
                        sums[key] += stats[key] * weight
                    with torch.no_grad():
                        entropy = token_entropy(logits.detach())
                        sums["entropy"] += float((entropy * sub.loss_mask).sum().item()) * weight_scale
                self.optimizer_steps += 1
        sums, tokens_seen = self._sum_over_processes(sums, tokens_seen)
        tokens_seen = tokens_seen or 1.0
        return {
            "loss": sums["loss"] / tokens_seen,
            "clip_fraction": sums["clip_frac"] / tokens_seen,
            "clip_fraction_dual": sums["clip_frac_lower"] / tokens_seen,
            "approx_kl": sums["approx_kl"] / tokens_seen,
            "entropy": sums["entropy"] / tokens_seen,
            "lr": float(self.scheduler.get_last_lr()[0]) if self.scheduler else self.config.optim.lr,
            "optimizer_steps": float(self.optimizer_steps),
        }

    def _sum_over_processes(self, sums: dict[str, float], tokens: float) -> tuple[dict[str, float], float]:
        """Each process saw its share of the rows: the step's statistics are sums over all processes."""
        if self.world_size == 1:
            return sums, tokens
        import torch.distributed as dist

        totals = torch.tensor([*sums.values(), tokens], dtype=torch.float64)
        dist.all_reduce(totals)
        return dict(zip(sums, totals[:-1].tolist(), strict=True)), float(totals[-1])

    def _my_micro_batches(self, mini: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
        """This process's rows of a mini-batch as (rows, loss scale) micro-batches.

        Every process must run the same number of backward passes (gradient collectives pair up);
        a process left without rows runs one row with its loss scaled to zero.
        """
        mine = mini[self.rank :: self.world_size]
        per_process = -(-mini.numel() // self.world_size)
        count = max(1, -(-per_process // self.config.optim.micro_batch_size))
        chunks = [c for c in torch.tensor_split(mine, count)]
        return [(c, 1.0) if c.numel() else (mini[:1], 0.0) for c in chunks]

    # -- weights and checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under HF names in the checkpoint's dtype (every rank must call it under ZeRO-3)."""
        module = self.engine.module
        if self.config.deepspeed.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        else:
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        if self.tied:
            state.pop("lm_head.weight", None)  # the embedding carries it
        return {k: v.to(self.checkpoint_dtype) for k, v in state.items()}

    def save_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """An HF checkpoint (weights + config + tokenizer) loadable by vLLM and transformers."""
        import shutil

        state = self.state_dict()
        if self.rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.engine.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, out_dir / name)

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state)

    def load_checkpoint(self, directory: Path, tag: str | None = None) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if client_state is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
        self.optimizer_steps = int(client_state.get("optimizer_steps", 0))
        if "shuffle_rng" in client_state:
            self.shuffle.set_state(client_state["shuffle_rng"])
        return client_state

    def weight_manifest(self) -> list[tuple[str, TensorInfo]]:
        """Names, dtypes and shapes of `state_dict()`, in its order (every rank must call it under ZeRO-3)."""
        return manifest(self.state_dict())

    def broadcast_weights(self, group: BroadcastGroup) -> None:
        """GPU only, NOT exercised by CI: rank 0 sends the full weights to the rollout workers over NCCL.

        Every rank calls it (ZeRO-3 gathers need all of them); rank 0 joins `group` once and broadcasts.
        """
        state = self.state_dict()
        if self.rank != 0:
            return
        if self._sender is None or self._sender.group != group:
            self._sender = NcclWeightSender(group)
        self._sender.broadcast(state)

    def rng_state(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps, "shuffle_rng": self.shuffle.get_state()}
