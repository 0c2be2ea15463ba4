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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlep.services.learner.algorithm import mini_batch_normalizer, policy_loss, warmup_lr
from rlep.services.learner.batch import ExperienceBatch, LogitProcessing, ScoringModel, mini_batches, score_chunk_count
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.deepspeed_setup import (
    TRAIN_DTYPES,
    choose_adam,
    deepspeed_config,
    init_distributed,
    load_deepspeed_op,
    load_model,
)
from rlep.services.learner.lora import AdapterOff, AdapterScoringModel, apply_lora, base_model, merged_weights
from rlep.services.learner.micro_batch_plan import MicroBatch, max_micro_batch_tokens, plan_micro_batches
from rlep.services.learner.mismatch import correction_weights
from rlep.services.learner.reference import load_reference
from rlep.services.learner.weight_push import WeightPusher, push_dtype
from rlep.services.rollout.client import PushResult, ReplicaTarget
from rlep.services.weights.broadcast import BroadcastGroup, WeightSender, manifest
from rlep.services.weights.config import WeightSyncConfig
from rlep.services.weights.payload import TensorInfo

__all__ = ["DeepSpeedPolicy", "checkpoint_dtype", "copy_tokenizer_files", "init_distributed"]

log = logging.getLogger(__name__)

# The update's statistics, summed on the device over micro-batches and read back once per update.
STAT_KEYS = ("loss", "clip_fraction", "clip_fraction_dual", "approx_kl", "entropy", "kl_ref", "tokens")

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


class DeepSpeedPolicy:
    def __init__(self, model_dir: Path, config: TrainConfig, rank: int = 0, world_size: int = 1):
        import deepspeed
        from transformers import AutoConfig

        torch.manual_seed(config.seed)
        self.config, self.rank, self.world_size = config, rank, world_size
        ds = config.deepspeed
        # Pushed weights must match the checkpoint the rollout workers loaded, dtype included. Read it
        # from the config before loading: loading in another dtype rewrites `model.config.dtype`.
        self.checkpoint_dtype = checkpoint_dtype(AutoConfig.from_pretrained(model_dir))
        self.train_dtype = TRAIN_DTYPES[ds.dtype]  # what `save_hf` writes: no upcast, no rounding
        offload = ds.offload_optimizer and ds.zero_stage > 0
        self.adam = choose_adam(ds.adam, torch.cuda.is_available(), offload, load_deepspeed_op)
        ds_config = deepspeed_config(config.optim, config.deepspeed, world_size, self.adam)
        model = load_model(model_dir, config.deepspeed, ds_config)
        self.tied = bool(model.config.tie_word_embeddings)
        self.lora = config.lora.enabled  # only the adapters train (lora.py)
        model = apply_lora(model, config.lora) if self.lora else model
        chunks = head_chunks(config)
        scorer = (AdapterScoringModel if self.lora else ScoringModel)(model, chunks=chunks)  # use_cache=False
        trained = [p for p in scorer.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=scorer, model_parameters=trained, config=ds_config)
        self.device: torch.device = torch.device(self.engine.device)
        log.info("learner rank %d on %s, %s AdamW, ZeRO-%d", rank, self.device, self.adam, ds.zero_stage)
        self.shuffle = torch.Generator().manual_seed(config.seed + 1)
        self.optimizer_steps = 0
        self.training_steps = 0  # `update` calls: the warm-up clock
        self._sender: WeightSender | None = None  # weight broadcast (rank 0), joined on first use
        self._pusher = WeightPusher()  # payload pushes from this process (rank 0)
        # The KL term's reference (reference.py): loaded only when a KL term is on.
        self.reference = None
        if config.algorithm.kl_coef and self.lora:  # the policy with its adapter off: the base never trains
            self.reference = AdapterOff(self.engine, model)
        elif config.algorithm.kl_coef:
            self.reference = load_reference(model_dir, config.deepspeed, ds_config, self.device, chunks)

    @property
    def hf_model(self) -> torch.nn.Module:
        return self.engine.module.model

    # -- forward passes ----------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """`[N, L-1]` logprobs of every next token under the current weights: prompt positions included, 0 where
        the next token is padding.

        Each process scores its own share of the rows; the shares are summed over processes (each row is
        non-zero on one process only), so every process returns the whole tensor, on the host.
        """
        self.engine.eval()
        return self._score(self.engine, batch)[0]

    @torch.no_grad()
    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """`logprobs` under the reference policy (the starting checkpoint; only with `algorithm.kl_coef` > 0)."""
        if self.reference is None:
            raise RuntimeError("no reference policy: algorithm.kl_coef is 0")
        return self._score(self.reference, batch)[0]

    @torch.no_grad()
    def logprobs_with_processed(
        self, batch: ExperienceBatch, temperature: float, top_p: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs`, and from the same forward pass those of the distribution a sampler at `temperature` and
        `top_p` draws from (vLLM's `processed_logprobs`): what a behavior correction compares under tempered
        sampling."""
        self.engine.eval()
        logprobs, processed = self._score(self.engine, batch, LogitProcessing(temperature, top_p))
        return logprobs, processed

    def _score(
        self, module, batch: ExperienceBatch, sampling: LogitProcessing | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`[N, L-1]` logprobs, `[N, L-1]` processed logprobs when `sampling` is given, else None), on the host."""
        outs = [torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=self.device)]
        if sampling is not None:
            outs.append(torch.zeros_like(outs[0]))
        for rows, scale in self._micro_batches(batch, torch.arange(batch.size)):
            sub = batch.select(rows).to(self.device)
            scores = module(
                input_ids=sub.tokens, attention_mask=sub.attention_mask, with_entropy=False, sampling=sampling
            )
            if scale:  # padding positions get 0, so the result does not depend on which rows shared a pass
                for out, values in zip(outs, scores, strict=False):
                    # (where, not a product: a processed logprob can be -inf, and -inf * 0 is NaN)
                    kept = torch.where(sub.attention_mask[:, 1:].bool(), values, 0.0)
                    out[rows.to(self.device), : sub.loss_mask.shape[1]] = kept
        if self.world_size > 1:
            import torch.distributed as dist

            for out in outs:
                dist.all_reduce(out)
        logprobs, *processed = (out.cpu() for out in outs)
        return logprobs, processed[0] if processed else None

    def _micro_batches(self, batch: ExperienceBatch, rows: torch.Tensor) -> list[MicroBatch]:
        """This process's micro-batches of `rows` (micro_batch_plan.py): by length, within the row and token caps."""
        optim = self.config.optim
        lengths = batch.attention_mask.sum(dim=1)
        return plan_micro_batches(
            rows, lengths, self.rank, self.world_size, optim.micro_batch_size, optim.micro_batch_tokens
        )

    # -- update ------------------------------------------------------------------------------
    def update(self, batch: ExperienceBatch, rows_per_mini_batch: int) -> dict[str, float]:
        """One training step: PPO epochs over shuffled mini-batches of `batch` (which must carry old_logprobs).

        Returns the step's statistics: `loss` is the mean over its optimizer steps of each mini-batch's
        loss (as computed on the mini-batch in one piece); `clip_fraction*`, `approx_kl` and `entropy`
        are means over all response tokens seen; `lr` is the lr every optimizer step of it used.
        Statistics are summed on the device and read back once, at the end.
        """
        if batch.old_logprobs is None:
            raise ValueError("old logprobs must be computed before the update")
        algo = self.config.algorithm
        lr = self._set_lr()
        self.engine.train()
        sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.device)
        count = max(1, round(batch.size / rows_per_mini_batch))
        steps = 0
        for _ in range(algo.ppo_epochs):
            for mini in mini_batches(batch.size, count, self.shuffle):
                sums += self._train_mini_batch(batch, mini)
                steps += 1
        self.training_steps += 1
        totals = dict(zip(STAT_KEYS, self._sum_over_processes(sums), strict=True))
        tokens = totals["tokens"] or 1.0
        return {
            "loss": totals["loss"] / steps,
            "clip_fraction": totals["clip_fraction"] / tokens,
            "clip_fraction_dual": totals["clip_fraction_dual"] / tokens,
            "approx_kl": totals["approx_kl"] / tokens,
            "entropy": totals["entropy"] / tokens,
            **({"kl_ref": totals["kl_ref"] / tokens} if self._kl_in_loss else {}),
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

    def _train_mini_batch(self, batch: ExperienceBatch, mini: torch.Tensor) -> torch.Tensor:
        """Accumulates this process's share of one mini-batch's gradient, then takes one optimizer step.

        Returns, on the device and in `STAT_KEYS` order, this process's share of the mini-batch's loss (the
        shares of all processes add up to the loss of the mini-batch in one piece) and token-weighted sums
        of the statistics.
        """
        algo = self.config.algorithm
        settings = algo.loss_settings
        normalizer = mini_batch_normalizer(batch.loss_mask[mini], algo.loss_agg, self.world_size)
        micros = self._micro_batches(batch, mini)
        sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.device)
        mini_tokens = 0.0  # counted on the host copies: no device sync, no copy to the device per micro-batch
        for i, (rows, scale) in enumerate(micros):
            host = batch.select(rows)
            tokens = float(host.loss_mask.sum()) * scale
            mini_tokens += tokens
            sub = host.to(self.device)
            new, entropy = self.engine(
                input_ids=sub.tokens, attention_mask=sub.attention_mask, entropy_grad=algo.entropy_coef > 0
            )
            loss, stats = policy_loss(
                new,
                sub.old_logprobs,
                sub.advantages,
                sub.loss_mask,
                settings,
                normalizer=normalizer,
                token_weights=self._token_weights(sub),
                ref_logprobs=sub.ref_logprobs,
                entropy=entropy,
            )
            self.engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
            self.engine.backward(loss * scale, scale_wrt_gas=False)
            self.engine.step()
            # Each micro-batch's loss is its part of the mini-batch's loss times world_size.
            parts = [
                loss.detach() * (scale / self.world_size),
                stats["clip_fraction"] * tokens,
                stats["clip_fraction_dual"] * tokens,
                stats["approx_kl"] * tokens,
                (entropy.detach() * sub.loss_mask).sum() * scale,
                stats.get("kl_ref", torch.zeros((), device=self.device)) * tokens,
            ]
            sums[:-1] += torch.stack([p.to(torch.float64) for p in parts])
        sums[-1] += mini_tokens  # STAT_KEYS ends with "tokens"
        self.optimizer_steps += 1
        return sums

    @property
    def _kl_in_loss(self) -> bool:
        algo = self.config.algorithm
        return algo.kl_coef > 0 and algo.kl_in == "loss"

    def _token_weights(self, sub: ExperienceBatch) -> torch.Tensor | None:
        """The behavior correction's weights per token (mismatch.py, docs/mismatch.md); None with `none`."""
        algo = self.config.algorithm
        if algo.correction == "none" or sub.behavior_logprobs is None:
            return None
        # Like with like: under tempered sampling the sampler's logprobs are of its processed distribution.
        old = sub.old_processed_logprobs if sub.old_processed_logprobs is not None else sub.old_logprobs
        return correction_weights(algo.correction, old, sub.behavior_logprobs, algo.behavior_weight_cap)

    def _sum_over_processes(self, sums: torch.Tensor) -> list[float]:
        """Each process saw its share of the rows: the step's statistics are sums over all processes. The
        collective runs on the backend's device (NCCL: this GPU; gloo: the CPU); one read back to the host."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(sums)
        return sums.tolist()

    # -- weights and checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under HF names in the checkpoint's dtype, on the host, on rank 0; ranks > 0 get {} and make no
        copy. Under ZeRO-3 every rank must call it (each takes part in every gather)."""
        return self._full_weights(copy=True)

    def _device_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor in `dtype` (default: the checkpoint's) on this process's device), in `state_dict`
        order, the tied head left out. Under ZeRO-3 each parameter is gathered alone and valid only until the next
        one is made, so no process holds more than one gathered parameter; every rank must run the iterator to its
        end."""
        import deepspeed

        dtype = dtype or self.checkpoint_dtype
        gather = self.config.deepspeed.zero_stage == 3
        yield from merged_weights(  # with LoRA: merged, one layer's W, A and B gathered at a time under ZeRO-3
            self.hf_model,
            dtype,
            frozenset({"lm_head.weight"} if self.tied else ()),  # the embedding carries a tied head
            lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=gather),
        )

    def _full_weights(self, copy: bool, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """`state_dict()` (in `dtype`, default the checkpoint's) on the host of rank 0, {} elsewhere; without `copy`
        (CPU training outside ZeRO-3) the tensors may be the module's own, valid until the next update: for a push
        that reads them at once.

        Only rank 0 sends or saves what this returns, so only rank 0 copies anything to the host: at 7B in bf16
        that is 15.2 GB, which every rank of a node would otherwise hold at once (docs/scaling.md, section 2)."""
        if self.rank != 0:
            self._join_gathers(dtype)
            return {}
        copy = copy or self.config.deepspeed.zero_stage == 3  # a gathered parameter is freed after its turn
        return {name: tensor.to("cpu", copy=copy) for name, tensor in self._device_weights(dtype)}

    def _join_gathers(self, dtype: torch.dtype | None = None) -> None:
        """A rank > 0's part in a call whose weights rank 0 alone uses: under ZeRO-3 every gather (a collective),
        keeping nothing; outside ZeRO-3 each rank holds whole weights already, so nothing."""
        if self.config.deepspeed.zero_stage == 3:
            for _ in self._device_weights(dtype):
                pass

    def push_weights(self, target: ReplicaTarget, version: int, sync: WeightSyncConfig) -> PushResult | None:
        """Rank 0 sends the full weights to the replicas of `target` itself (weight_push.py); under ZeRO-3 every
        rank takes part in gathering them. Returns who took `version` (rank 0; None elsewhere)."""
        weights = self._full_weights(copy=False, dtype=push_dtype(target, self.checkpoint_dtype))
        if self.rank != 0:
            return None
        return self._pusher.push(weights, target, version, sync)

    def save_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """An HF checkpoint (weights + config + `tokenizer_dir`'s tokenizer files) loadable by vLLM and transformers.

        The weights are written in the training dtype (`deepspeed.dtype`), whatever the starting checkpoint's: a
        model trained in bf16 is not upcast to a float32 file twice its size, and one trained in float32 keeps the
        updates that rounding to bf16 would lose. config.json says that dtype (vLLM's `dtype: auto` reads it).
        Pushes to rollout go in the replicas' engine dtype (`weight_push.push_dtype`)."""
        state = self._full_weights(copy=True, dtype=self.train_dtype)
        if self.rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        base_model(self.hf_model).save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        config = copy.deepcopy(self.hf_model.config)
        config.dtype = self.train_dtype
        config.save_pretrained(out_dir)
        copy_tokenizer_files(tokenizer_dir, out_dir)

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        # Under LoRA the frozen base is the starting checkpoint: only the adapters and their optimizer state are saved.
        self.engine.save_checkpoint(
            str(directory), tag=tag, client_state=client_state, exclude_frozen_parameters=self.lora
        )

    def load_checkpoint(self, directory: Path, tag: str | None = None) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if client_state is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
        self.optimizer_steps = int(client_state.get("optimizer_steps", 0))
        self.training_steps = int(client_state.get("training_steps", 0))
        if "shuffle_rng" in client_state:
            self.shuffle.set_state(client_state["shuffle_rng"])
        if "learner_torch_rng" in client_state:
            torch.set_rng_state(client_state["learner_torch_rng"])
        if "learner_cuda_rng" in client_state:
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(client_state["learner_cuda_rng"], self.device)
            else:
                log.info("checkpoint written on CUDA, resumed on %s: its CUDA generator state is not used", self.device)
        return client_state

    def weight_manifest(self) -> list[tuple[str, TensorInfo]]:
        """Names, dtypes and shapes of `state_dict()`, in its order, on rank 0 ([] elsewhere; every rank must call it
        under ZeRO-3). Read off each tensor as it comes (a meta tensor keeps dtype and shape): no host copy."""
        if self.rank != 0:
            self._join_gathers()
            return []
        return manifest({name: tensor.to("meta") for name, tensor in self._device_weights()})

    def broadcast_weights(self, group: BroadcastGroup) -> None:
        """Rank 0 sends the full weights to the rollout workers over `group.backend` (NCCL or gloo).

        Every rank calls it (ZeRO-3 gathers need all of them); rank 0 joins `group` once and broadcasts.
        A failed broadcast leaves its group (the transport's next push names a new one).
        """
        if self.rank != 0:
            self._join_gathers()  # rank 0 sends each parameter straight from the gather on its device
            return
        tensors = (tensor for _, tensor in self._device_weights())
        if self._sender is not None and self._sender.group != group:
            self._sender.close()
            self._sender = None
        sender, self._sender = self._sender or WeightSender(group), None
        sender.broadcast(tensors)
        self._sender = sender  # kept only after a broadcast that completed

    def broadcast_address(self) -> str:
        """This host's address as the replicas' hosts reach it (RLEP_NODE_ADDRESS, else Ray's node IP): asked of
        rank 0, where the broadcast group's store listens (`weight_sync.master_address: auto`)."""
        from rlep.services.weights.address import node_address

        return node_address()

    def sender_device(self) -> str:
        """The device type this process trains on (`cuda` or `cpu`): rank 0's decides the broadcast's backend."""
        return self.device.type

    def rng_state(self) -> dict[str, Any]:
        """The learner's counters and generators: the mini-batch shuffle, this process's torch CPU generator and,
        on CUDA, its device's generator (every rank is seeded alike, so rank 0's stand for all)."""
        state = {
            "optimizer_steps": self.optimizer_steps,
            "training_steps": self.training_steps,
            "shuffle_rng": self.shuffle.get_state(),
            "learner_torch_rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["learner_cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state


def head_chunks(config: TrainConfig) -> int:
    """How many chunks every forward applies the LM head in (batch.py, `score_chunk_count`): under ZeRO-3 one count
    for the run, sized for its largest micro-batch, so DeepSpeed's prefetch trace holds from one micro-batch to the
    next; elsewhere there is no trace to keep and a batch takes as many 1,024-position chunks as it needs (1)."""
    if config.deepspeed.zero_stage != 3:
        return 1
    optim = config.optim
    longest_row = config.data.max_prompt_tokens + config.algorithm.max_response_tokens
    return score_chunk_count(max_micro_batch_tokens(optim.micro_batch_size, optim.micro_batch_tokens, longest_row))


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
