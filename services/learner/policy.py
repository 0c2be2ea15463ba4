"""The trained policy on DeepSpeed: logprobs of a batch, PPO updates with DAPO's loss, weights, checkpoints.

One `DeepSpeedPolicy` per learner process. On this CPU machine kind DeepSpeed runs its CPU
accelerator over gloo (1 or more processes); on GPUs the same code runs over NCCL. ZeRO stage,
dtype, gradient checkpointing, optimizer, warm-up and clipping come from the run's config.

The engine's module is a `ScoringModel`: its forward returns per-token logprobs and entropy, with
the LM head applied chunk by chunk, so no full-vocabulary float32 tensor is built per micro-batch.

Gradient accumulation is driven by hand: every micro-batch's loss is normalised by the whole
mini-batch's denominator, in every loss mode (`mini_batch_normalizer`: its token count for
token-mean, its number of non-empty sequences for seq-mean-*), DeepSpeed is told where the
mini-batch ends (`set_gradient_accumulation_boundary`), so one optimizer step sees exactly the
mini-batch's gradient however it was split over micro-batches and processes.

The lr is set by hand at the start of each `update` (one training step): linear warm-up counted in
training steps (`warmup_lr`), so every mini-batch of a step shares one lr, as in verl.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import torch

from rlep.common.algorithm import behavior_weights, mini_batch_normalizer, policy_loss, warmup_lr
from rlep.services.learner.batch import ExperienceBatch, ScoringModel, micro_batches, mini_batches
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.weight_push import WeightPusher
from rlep.services.rollout.client import PushResult, ReplicaTarget
from rlep.services.weights.broadcast import BroadcastGroup, WeightSender, manifest
from rlep.services.weights.config import WeightSyncConfig
from rlep.services.weights.payload import TensorInfo

log = logging.getLogger(__name__)

TRAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Tokenizer files of an HF checkpoint, copied byte for byte into saved checkpoints: recent transformers
# keeps the chat template in chat_template.jinja (older ones inside tokenizer_config.json). Re-saving
# through AutoTokenizer instead rewrites what it resolved: the tiny model's tokenizer comes back as
# Qwen2Tokenizer with an unk token it never had, and char-level vocabularies may come back garbled.
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.*",
    "additional_chat_templates",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "generation_config.json",
)


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
    # No DeepSpeed scheduler: it counts optimizer steps, and warm-up counts training steps.
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


class DeepSpeedPolicy:
    def __init__(self, model_dir: Path, config: TrainConfig, rank: int = 0, world_size: int = 1):
        import deepspeed
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(config.seed)
        self.config, self.rank, self.world_size = config, rank, world_size
        ds = config.deepspeed
        # Pushed weights must match the checkpoint the rollout workers loaded, dtype included. Read it
        # from the config before loading: loading in another dtype rewrites `model.config.dtype`.
        self.checkpoint_dtype = checkpoint_dtype(AutoConfig.from_pretrained(model_dir))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TRAIN_DTYPES[ds.dtype])
        if ds.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tied = bool(model.config.tie_word_embeddings)
        scorer = ScoringModel(model)  # forwards run with use_cache=False
        self.engine, _, _, _ = deepspeed.initialize(
            model=scorer, model_parameters=list(scorer.parameters()), config=deepspeed_config(config, world_size)
        )
        self.shuffle = torch.Generator().manual_seed(config.seed + 1)
        self.optimizer_steps = 0
        self.training_steps = 0  # `update` calls: the warm-up clock
        self._sender: WeightSender | None = None  # weight broadcast (rank 0), joined on first use
        self._pusher = WeightPusher()  # payload pushes from this process (rank 0)

    @property
    def hf_model(self) -> torch.nn.Module:
        return self.engine.module.model

    # -- forward passes ----------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """`[N, L-1]` logprobs of every next token under the current weights (masked positions included)."""
        self.engine.eval()
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        for rows in micro_batches(torch.arange(batch.size), self.config.optim.micro_batch_size):
            sub = batch.select(rows)
            logprobs, _ = self.engine(input_ids=sub.tokens, attention_mask=sub.attention_mask, with_entropy=False)
            out[rows, : sub.loss_mask.shape[1]] = logprobs
        return out

    # -- update ------------------------------------------------------------------------------
    def update(self, batch: ExperienceBatch, rows_per_mini_batch: int) -> dict[str, float]:
        """One training step: PPO epochs over shuffled mini-batches of `batch` (which must carry old_logprobs).

        Returns the step's statistics: `loss` is the mean over its optimizer steps of each mini-batch's
        loss (as computed on the mini-batch in one piece); `clip_fraction*`, `approx_kl` and `entropy`
        are means over all response tokens seen; `lr` is the lr every optimizer step of it used.
        """
        if batch.old_logprobs is None:
            raise ValueError("old logprobs must be computed before the update")
        algo = self.config.algorithm
        lr = self._set_lr()
        self.engine.train()
        sums = dict.fromkeys(("loss", "clip_fraction", "clip_fraction_dual", "approx_kl", "entropy", "tokens"), 0.0)
        count = max(1, round(batch.size / rows_per_mini_batch))
        steps = 0
        for _ in range(algo.ppo_epochs):
            for mini in mini_batches(batch.size, count, self.shuffle):
                self._train_mini_batch(batch, mini, sums)
                steps += 1
        self.training_steps += 1
        sums = self._sum_over_processes(sums)
        tokens = sums["tokens"] or 1.0
        return {
            "loss": sums["loss"] / steps,
            "clip_fraction": sums["clip_fraction"] / tokens,
            "clip_fraction_dual": sums["clip_fraction_dual"] / tokens,
            "approx_kl": sums["approx_kl"] / tokens,
            "entropy": sums["entropy"] / tokens,
            "lr": lr,
            "optimizer_steps": float(self.optimizer_steps),
        }

    def _set_lr(self) -> float:
        """Sets this training step's warm-up lr on every parameter group; returns it as the optimizer holds it."""
        optim = self.config.optim
        lr = warmup_lr(self.training_steps, optim.lr, optim.warmup_steps)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return float(self.engine.get_lr()[0])

    def _train_mini_batch(self, batch: ExperienceBatch, mini: torch.Tensor, sums: dict[str, float]) -> None:
        """Accumulates this process's share of one mini-batch's gradient, then takes one optimizer step.

        Adds to `sums` this process's share of the mini-batch's loss (the shares of all processes
        add up to the loss of the mini-batch in one piece) and token-weighted sums of the statistics.
        """
        algo = self.config.algorithm
        normalizer = mini_batch_normalizer(batch.loss_mask[mini], algo.loss_agg, self.world_size)
        micros = self._my_micro_batches(mini)
        for i, (rows, weight_scale) in enumerate(micros):
            sub = batch.select(rows)
            new, entropy = self.engine(input_ids=sub.tokens, attention_mask=sub.attention_mask)
            loss, stats = policy_loss(
                new,
                sub.old_logprobs,
                sub.advantages,
                sub.loss_mask,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                clip_c=algo.clip_c,
                agg=algo.loss_agg,
                normalizer=normalizer,
                token_weights=self._token_weights(sub),
            )
            self.engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
            self.engine.backward(loss * weight_scale, scale_wrt_gas=False)
            self.engine.step()
            weight = float(sub.loss_mask.sum().item()) * weight_scale
            sums["tokens"] += weight
            # Each micro-batch's loss is its part of the mini-batch's loss times world_size.
            sums["loss"] += loss.item() * weight_scale / self.world_size
            for key in ("clip_fraction", "clip_fraction_dual", "approx_kl"):
                sums[key] += stats[key] * weight
            sums["entropy"] += float((entropy * sub.loss_mask).sum().item()) * weight_scale
        self.optimizer_steps += 1

    def _token_weights(self, sub: ExperienceBatch) -> torch.Tensor | None:
        """`truncated_is`: pi_old / pi_sampler per token, truncated (README, *Overlap*); otherwise None."""
        algo = self.config.algorithm
        if algo.correction != "truncated_is" or sub.behavior_logprobs is None:
            return None
        return behavior_weights(sub.old_logprobs, sub.behavior_logprobs, algo.behavior_weight_cap)

    def _sum_over_processes(self, sums: dict[str, float]) -> dict[str, float]:
        """Each process saw its share of the rows: the step's statistics are sums over all processes."""
        if self.world_size == 1:
            return sums
        import torch.distributed as dist

        totals = torch.tensor(list(sums.values()), dtype=torch.float64)
        dist.all_reduce(totals)
        return dict(zip(sums, totals.tolist(), strict=True))

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
        return self._full_weights(copy=True)

    def _full_weights(self, copy: bool) -> dict[str, torch.Tensor]:
        """The full weights; without `copy` (ZeRO 0-2 only) CPU tensors of the checkpoint's dtype are the
        module's own, valid until the next update: for a push that reads them at once."""
        module = self.hf_model
        if self.config.deepspeed.zero_stage == 3:
            import deepspeed

            # Gathered parameters live only inside this block: always copied out.
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        else:
            state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
            if copy:
                state = {k: v.clone() for k, v in state.items()}
        if self.tied:
            state.pop("lm_head.weight", None)  # the embedding carries it
        return {k: v.to(self.checkpoint_dtype) for k, v in state.items()}

    def push_weights(self, target: ReplicaTarget, version: int, sync: WeightSyncConfig) -> PushResult | None:
        """Rank 0 sends the full weights to the replicas of `target` itself (weight_push.py); under ZeRO-3 every
        rank takes part in gathering them. Returns who took `version` (rank 0; None elsewhere)."""
        if self.rank != 0 and self.config.deepspeed.zero_stage != 3:
            return None
        weights = self._full_weights(copy=False)
        if self.rank != 0:
            return None
        return self._pusher.push(weights, target, version, sync)

    def save_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """An HF checkpoint (weights + config + `tokenizer_dir`'s tokenizer files) loadable by vLLM and transformers."""
        state = self.state_dict()
        if self.rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.hf_model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        # save_pretrained writes the module's (training) dtype into config.json; the weights it saved
        # are in the checkpoint's dtype, and vLLM's `dtype: auto` reads the config.
        config = copy.deepcopy(self.hf_model.config)
        config.dtype = self.checkpoint_dtype
        config.save_pretrained(out_dir)
        copy_tokenizer_files(tokenizer_dir, out_dir)

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state)

    def load_checkpoint(self, directory: Path, tag: str | None = None) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if client_state is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
        self.optimizer_steps = int(client_state.get("optimizer_steps", 0))
        self.training_steps = int(client_state.get("training_steps", 0))
        if "shuffle_rng" in client_state:
            self.shuffle.set_state(client_state["shuffle_rng"])
        return client_state

    def weight_manifest(self) -> list[tuple[str, TensorInfo]]:
        """Names, dtypes and shapes of `state_dict()`, in its order (every rank must call it under ZeRO-3)."""
        return manifest(self.state_dict())

    def broadcast_weights(self, group: BroadcastGroup) -> None:
        """Rank 0 sends the full weights to the rollout workers over `group.backend` (NCCL or gloo).

        Every rank calls it (ZeRO-3 gathers need all of them); rank 0 joins `group` once and broadcasts.
        A failed broadcast leaves its group (the transport's next push names a new one).
        """
        state = self.state_dict()
        if self.rank != 0:
            return
        if self._sender is not None and self._sender.group != group:
            self._sender.close()
            self._sender = None
        sender, self._sender = self._sender or WeightSender(group), None
        sender.broadcast(state)
        self._sender = sender  # kept only after a broadcast that completed

    def broadcast_address(self) -> str:
        """This node's address: rank 0 of a local policy is this process; the broadcast group's store listens here."""
        import ray

        return ray.util.get_node_ip_address()

    def rng_state(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "training_steps": self.training_steps,
            "shuffle_rng": self.shuffle.get_state(),
        }


def checkpoint_dtype(hf_config) -> torch.dtype:
    """The dtype an HF config says its weights are stored in (float32 when it does not say)."""
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def copy_tokenizer_files(source: Path, target: Path) -> list[str]:
    """Copies every tokenizer file (`TOKENIZER_FILES`) of checkpoint `source` into `target`; returns their names."""
    import shutil

    copied = []
    for path in sorted({p for pattern in TOKENIZER_FILES for p in source.glob(pattern)}):
        if path.is_dir():
            shutil.copytree(path, target / path.name, dirs_exist_ok=True)
        else:
            shutil.copy(path, target / path.name)
        copied.append(path.name)
    return copied
