"""Configuration of a training run (`rlep train --config X.yaml`). Defaults are RLEP's recipe.

RLEP (arXiv 2507.07451) trains Qwen2.5-Math-7B with DAPO's verl recipe without dynamic sampling,
mini-batch 64 prompts ("DAPO-nodyn-bs64"): 512 prompts per step, 16 fresh samples each at
T=1.0 / top-p 1.0, prompts left-truncated to 1024 tokens, responses up to 3072 tokens with a
512-token overlong buffer, lr 1e-6 with 10 warm-up training steps, clip 0.2 / 0.28, dual-clip 10,
token-mean loss; RLEP adds M=2 replayed successes per question. These defaults equal
`configs/recipes/rlep.yaml`; the other rows of the paper's Table 1 are files beside it. The demo and
the tests override sizes, not the recipe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlep.common.config import StrictModel, TlsFiles
from rlep.services.learner.algorithm import LossAgg, LossSettings
from rlep.services.learner.mismatch import Correction
from rlep.services.learner.replay_rules import ReplayRuleConfig
from rlep.services.learner.tool_rollouts import ToolUseConfig
from rlep.services.replay.client import Strategy
from rlep.services.rollout.config import (
    SERVICE_PATTERN,
    EngineConfig,
    GenerateDeadline,
    port_range_error,
    port_ranges_overlap_error,
)
from rlep.services.verifier.config import ScorerSettings
from rlep.services.weights.config import AutoSyncConfig, WeightSyncConfig


class DynamicSamplingConfig(StrictModel):
    """DAPO's dynamic sampling: drop groups whose fresh rewards are all equal, generate more until full."""

    enabled: bool = False
    questions_per_round: int | None = Field(None, ge=1)
    """Questions generated per round (verl's `gen_batch_size`; DAPO: 3 x questions_per_step); None = B."""
    max_rounds: int = Field(10, ge=1)
    """Bound on generation rounds per step (verl's `max_num_gen_batches`). A step that is still short
    after it trains on the groups it kept (and says so in its record) instead of failing."""
    metric: Literal["acc", "score"] = "acc"
    """What must vary within a group: verified correctness (`acc`) or the shaped reward (`score`)."""


class AlgorithmConfig(StrictModel):
    questions_per_step: int = Field(512, ge=1)
    """B: training questions per step."""
    fresh_per_question: int = Field(16, ge=1)
    """G: fresh rollouts per question."""
    replayed_per_question: int = Field(2, ge=0)
    """M: replayed successes per question (0 = the DAPO-nodyn baseline, same code path)."""
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_response_tokens: int = Field(3072, ge=1)
    """Generation limit; replayed answers are cut to it too."""
    mini_batch_questions: int = Field(64, ge=1)
    """PPO mini-batch in questions, counted in fresh sequences as verl does: one optimizer step per
    `mini_batch_questions x G` rows, so M replayed rows per question add updates (B=512, G=16, M=2,
    64 -> 9 updates per step). `mini_batch_rows: all` counts G + M instead."""
    mini_batch_rows: Literal["fresh", "all"] = "fresh"
    """What a mini-batch's `mini_batch_questions` counts: `fresh` (G rows per question, verl's and the paper's
    reading: replay adds updates) or `all` (G + M: as many updates per step as the M=0 baseline, the control
    that separates replay's effect from its extra updates)."""
    ppo_epochs: int = Field(1, ge=1)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    clip_c: float = Field(10.0, gt=1)
    loss_agg: LossAgg = "token-mean"
    overlong_buffer_tokens: int = Field(512, ge=0)
    """DAPO's soft overlong punishment zone before max_response_tokens (0 = off); fresh and replayed alike."""
    overlong_penalty: float = Field(1.0, ge=0)
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    replay_strategy: Strategy = Strategy.UNIFORM
    """Beyond the reference (off by default): how replayed successes are chosen."""
    replay_priority: Literal["stored", "policy_surprise"] = "stored"
    """Beyond the reference (issue 48): the priorities `replay_strategy: prioritized` draws a question's successes
    by. `stored`: what the pool holds (1 when added, or what `UpdatePriorities` set). `policy_surprise`: after each
    step's old-logprob pass, each replayed row's stored success gets priority max(`replay_priority_floor`, 1 - p),
    p = exp(mean logprob per token) the policy's per-token chance of that answer, so answers the policy already
    samples itself are drawn less (learner/replay_priorities.py). Needs `prioritized` and M > 0."""
    replay_priority_floor: float = Field(0.05, gt=0, le=1)
    """The least priority `policy_surprise` gives: a mastered answer is drawn less, never never."""
    replay_rule: ReplayRuleConfig = ReplayRuleConfig()
    """Beyond the reference: whether a group gets replay at all (`always`, the paper's, by default; `rescue`, `band`,
    retirement: `learner.replay_rules`), and the per-question outcomes reported to the replay service's history."""
    reverify_replayed: bool = True
    """Score replayed answers with this run's verifier like fresh ones (the reference's reward manager
    scores the whole batch); False = trust the stored reward."""
    require_replay: bool = False
    """With M > 0, fail the step (instead of warning) when it gets no replayed answer at all."""
    online_replay: bool = False
    """Beyond the reference: add this run's new successes to the pool as they appear."""
    max_replayed_fraction: float | None = Field(None, gt=0, le=1)
    """Beyond the reference: cap on replayed / all responses of a group (None = no cap)."""
    max_staleness: int = Field(0, ge=0)
    """Beyond the reference (off by default): k >= 1 generates the next k steps' samples on a background
    thread while the current step trains, on weights at most k versions older than the weights they train
    (verl's one-step-off-policy recipe, prime-rl's async level). 0 = the paper's synchronous step. Groups
    staler than k (e.g. from a replica that rejoined on old weights) are dropped and counted in the step
    record. Old logprobs are recomputed under the learner's weights before the update (docs/learner.md, *Overlap*)."""
    behavior_correction: Literal["auto", "none", "truncated_is", "seq_truncated_is", "masked_is", "seq_masked_is"] = (
        "auto"  # "auto", "none" and mismatch.CORRECTIONS (tests/unit/test_mismatch.py checks they agree)
    )
    """Beyond the reference: how fresh samples drawn by other weights than the update's old policy are corrected
    (docs/learner.md, *Overlap*). `none`: the PPO ratio starts from old logprobs recomputed under the learner's
    weights and the gap to the sampler is ignored (verl's one-step-off-policy recipe). `truncated_is`: each fresh
    token's loss is also weighted by min(pi_old / pi_sampler, behavior_weight_cap), pi_sampler being the sampler's
    logprob (AReaL's decoupled objective, truncated as in TIS); replayed rows get weight 1. `seq_truncated_is`: the
    sequence's ratio, truncated, on all its tokens; `masked_is` (IcePop): tokens whose ratio leaves [1/cap, cap] are
    left out; `seq_masked_is`: sequences whose geometric-mean ratio leaves it are (docs/mismatch.md). They correct
    the train/inference mismatch at any staleness, 0 included. Under tempered or top-p sampling the ratio is of the
    sampling distributions: the replicas return vLLM's `processed_logprobs` and the learner scores its old policy at
    the same temperature and top-p, in the old-logprob pass. `auto` (default): `truncated_is` when
    max_staleness >= 1 and the sampler is untempered, else `none` — so the synchronous step stays the paper's.
    Measured on the demo with k=1: `none` lost 0.08 held-out accuracy, `truncated_is` agreed with the synchronous
    run."""
    kl_coef: float = Field(0.0, ge=0)
    """Beyond DAPO and RLEP (which run without one): a KL term to the reference policy, the starting checkpoint
    (docs/algorithm.md, *KL and entropy*). 0 = none, and no reference model is loaded."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimator of KL(pi || pi_ref) per token: k1 = log ratio, k2 = its square / 2, k3 (GRPO's)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """`loss`: `kl_coef` x the estimate joins each token's loss (GRPO, verl `use_kl_loss`); `reward`: each
    sequence's reward loses `kl_coef` x its summed estimate under the old policy before advantages are normalised
    (verl `use_kl_in_reward`, PPO's classic penalty)."""
    entropy_coef: float = Field(0.0, ge=0)
    """An entropy bonus: each token's loss loses `entropy_coef` x the policy's entropy there. 0 = none."""
    behavior_weight_cap: float = Field(2.0, ge=1)
    """Upper bound of a truncated weight; [1/cap, cap] is the band a masked correction keeps."""

    @property
    def loss_settings(self) -> LossSettings:
        """What `policy_loss` needs of this config; the KL term joins the loss only with `kl_in: loss`."""
        return LossSettings(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            clip_c=self.clip_c,
            agg=self.loss_agg,
            kl_coef=self.kl_coef if self.kl_in == "loss" else 0.0,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
        )

    @property
    def mini_batch_size(self) -> int:
        """Rows per optimizer step (`mini_batch_rows`)."""
        per_question = self.fresh_per_question
        if self.mini_batch_rows == "all":
            per_question += self.replayed_per_question
        return self.mini_batch_questions * per_question

    @property
    def untempered(self) -> bool:
        return self.temperature == 1.0 and self.top_p == 1.0

    @model_validator(mode="after")
    def _priority_has_effect(self) -> AlgorithmConfig:
        # Refused rather than ignored: priorities only change draws under `prioritized`, and only with replay on.
        if self.replay_priority != "stored" and (
            self.replay_strategy != Strategy.PRIORITIZED or self.replayed_per_question == 0
        ):
            raise ValueError(
                f"replay_priority: {self.replay_priority} changes nothing without replay_strategy: prioritized and "
                f"replayed_per_question > 0 (now {self.replay_strategy.value}, M={self.replayed_per_question})"
            )
        return self

    @property
    def logprobs_mode(self) -> Literal["raw_logprobs", "processed_logprobs"]:
        """Which of vLLM's logprobs the sampler returns and the learner compares them with: the model's own (raw),
        or, for a behavior correction under tempered or top-p sampling, those of the distribution sampled from
        (processed: the importance weight is a ratio of the sampling distributions)."""
        return "processed_logprobs" if self.correction != "none" and not self.untempered else "raw_logprobs"

    @property
    def correction(self) -> Correction | Literal["none"]:
        """`behavior_correction` with `auto` resolved."""
        if self.behavior_correction != "auto":
            return self.behavior_correction
        return "truncated_is" if self.max_staleness >= 1 and self.untempered else "none"


class OptimConfig(StrictModel):
    lr: float = Field(1e-6, gt=0)
    warmup_steps: int = Field(10, ge=0)
    """TRAINING steps of linear warm-up, then constant (the recipe): training step k (0-based) uses
    `lr * min(1, (k+1) / warmup_steps)` for every optimizer step of its mini-batches, as verl steps its
    scheduler once per training step; unlike verl/HF no step runs at lr 0. 0 = the full lr throughout."""
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward at most; gradients accumulate up to the mini-batch."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Token budget of a forward/backward (verl's `ppo_max_token_len_per_gpu` with `use_dynamic_bsz`): rows,
    longest first, share a micro-batch while rows x its longest row <= this (a longer row runs alone), up to
    `micro_batch_size` rows. None = `micro_batch_size` rows. Rows are sorted by length either way
    (micro_batch_plan.py), so padding stays small; the gradient does not depend on the split."""


class DeepSpeedConfig(StrictModel):
    zero_stage: int = Field(2, ge=0, le=3)
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype the model is loaded and trained in (bf16: DeepSpeed keeps float32 master weights). Weights pushed
    to rollout are cast to the replicas' engine dtype (the NCCL broadcast: the starting checkpoint's); a
    checkpoint's HF export keeps this dtype."""
    num_processes: int = Field(1, ge=1)
    """Data-parallel learner processes (Ray actors); gloo on CPU, NCCL on GPU."""
    offload_optimizer: bool = False
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (HF gradient checkpointing): less memory
    per micro-batch for about one more forward pass of compute."""
    adam: Literal["auto", "torch", "deepspeed"] = "auto"
    """The AdamW implementation (deepspeed_setup.py). `auto`: DeepSpeed's FusedAdam on CUDA and its CPU Adam under
    `offload_optimizer`, where the op loads (prebuilt, or JIT-built at start), else PyTorch's fused AdamW with a
    warning naming why; on a CPU machine without offload PyTorch's AdamW. `torch`: PyTorch's AdamW always (fused on
    CUDA or under offload). `deepspeed`: DeepSpeed's op or fail, naming why."""


class CheckpointConfig(StrictModel):
    dir: Path | None = None
    """Where checkpoints go (None = no checkpoints)."""
    every_steps: int = Field(50, ge=1)
    """A checkpoint every this many steps, and one after the last step."""
    keep_last: int = Field(2, ge=1)
    """How many `step_N` directories (DeepSpeed state and HF export) stay on disk; older ones are removed once
    the newest is written, so keep_last + 1 exist for the moment in between. Size: docs/learner.md, *Checkpoints*."""


class EndpointsConfig(StrictModel):
    """Where the services are. Empty = start them (locally on Ray); set = use them (e.g. Kubernetes)."""

    rollout: list[str] = []
    """Rollout replica addresses; empty (and no `rollout_service`) = a Ray Serve deployment started by `rlep train`."""
    rollout_service: str | None = Field(None, pattern=SERVICE_PATTERN)
    """`NAME:PORT`: a DNS name resolving to every rollout replica's IP, which all serve on PORT (Kubernetes: a
    headless Service of the replicas' pods). Re-resolved before every step, so a replica that comes back on a
    new pod joins again (services/rollout/discovery.py). Exclusive with `rollout`."""

    @model_validator(mode="after")
    def _one_rollout_source(self) -> EndpointsConfig:
        if self.rollout and self.rollout_service:
            raise ValueError("endpoints.rollout and endpoints.rollout_service both name the replicas: set one")
        return self

    verifier: str | None = None
    replay: str | None = None
    sandbox: str | None = None
    """With `tools`: a sandbox service (`rlep serve sandbox`) that runs the tool calls; None = the sandbox runs in the
    learner's driver process (bubblewrap must be there)."""
    auth_token_file: Path | None = None
    service_outage_s: float = Field(120.0, ge=0)
    """How long the learner waits out a verifier or replay service that does not answer (a container or pod
    restarting): its calls are retried with backoff, each retry logged, and the run fails only after this long."""
    generate_deadline: GenerateDeadline = GenerateDeadline()
    """Deadline of each Generate call to the rollout replicas (these or those `rlep train` starts), from the call's
    size; a call past it is retried on another replica (docs/scaling.md, *Generate deadline*)."""


class LocalServicesConfig(StrictModel):
    """Services `rlep train` starts on Ray when `endpoints` leaves them empty."""

    rollout_replicas: int = Field(1, ge=1)
    rollout_cpus: float = Field(1.0, ge=0)
    """Ray CPUs reserved per rollout replica."""
    rollout_gpus: float | None = Field(None, ge=0)
    """Ray GPUs per rollout replica; None = the engine's `tensor_parallel_size` when the Ray cluster has GPUs, else 0.
    With the learner's GPUs they must fit the cluster, or `rlep train` refuses before starting anything."""
    rollout_max_per_node: int | None = Field(None, ge=1)
    """At most this many replicas on one Ray node (1 spreads them over the nodes); None = Ray's choice."""
    rollout_port: int = Field(0, ge=0, le=65535)
    """First gRPC port of the replicas on each node (a firewall can then name them); 0 = any free port. A node's
    replicas take `rollout_port` + a free slot, one slot per replica it may hold (`rollout_max_per_node`, else
    `rollout_replicas`); no free slot fails the replica's start."""
    rollout_metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus /metrics of every replica (the `rlep_rollout_*` series of `rlep serve rollout --metrics-port`, same
    host and token as its gRPC); None = no /metrics, 0 = any free port each. Otherwise a node's replicas take
    `rollout_metrics_port` + a free slot, one slot per replica it may hold, as `rollout_port` does; no free slot
    fails the replica's start naming this setting. Each replica's address is logged at start and kept in the
    replica registry (`ServiceStack.rollout_metrics_urls`)."""
    rollout_engine: EngineConfig = EngineConfig()
    """vLLM arguments of the replicas; `model` is replaced by the run's starting checkpoint."""
    verifier_workers: int = Field(1, ge=1)
    replay_redis_url: str | None = None
    """Redis of the replay service; None = an embedded redis-server under `replay_redis_dir`."""
    replay_redis_dir: Path = Path.home() / ".cache" / "rlep" / "redis"
    """Data directory (AOF, password) of that embedded redis-server: runs that share a pool (collect, then train)
    share it; one process at a time owns it (a second run on one machine gets its own, or `replay_redis_url`)."""
    learner_cpus: float = Field(1.0, ge=0)
    """Ray CPUs reserved per learner process."""
    learner_gpus: float | None = Field(None, ge=0, le=1)
    """Ray GPUs per learner process (one process drives one GPU: more GPUs = more `deepspeed.num_processes`);
    None = 1 when the Ray cluster has GPUs, else 0. A fraction lets a single learner process share its GPU."""

    @model_validator(mode="after")
    def _rollout_ports_fit(self) -> LocalServicesConfig:
        slots = self.rollout_max_per_node or self.rollout_replicas
        if error := port_range_error(self.rollout_port, slots):
            raise ValueError(f"local.rollout_port: {error}")
        if self.rollout_metrics_port and (error := port_range_error(self.rollout_metrics_port, slots)):
            raise ValueError(f"local.rollout_metrics_port: {error}")
        if error := port_ranges_overlap_error(self.rollout_port, self.rollout_metrics_port, slots):
            raise ValueError(f"local.rollout_metrics_port: {error} (local.rollout_port)")
        return self


class DataConfig(StrictModel):
    train_files: list[Path] = []
    """verl/DAPO parquet files (`prompt`, `reward_model.ground_truth`, `data_source`)."""
    shuffle: bool = True
    max_prompt_tokens: int = Field(1024, ge=1)
    """Chat-templated prompts longer than this are left-truncated (the reference's `truncation: left`),
    and further when prompt + max_response_tokens would not fit the rollout model; counted per step."""
    seed_pool_from_candidates: bool = True
    """When a training file carries `reward_model.candidates` (RLEP's released format) and M > 0, import
    them into `replay_pool` at start (idempotent; skipped when the pool already holds them all)."""


class PeriodicEvalConfig(StrictModel):
    every_steps: int = Field(0, ge=0)
    """Evaluate the rollout policy on `files` every this many steps (0 = never)."""
    files: list[Path] = []
    samples_per_question: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    max_questions: int = Field(512, ge=1)


class CollectConfig(StrictModel):
    """Phase 1 of RLEP (`rlep collect`): N answers per training question from a trained policy, verified ones kept."""

    samples_per_question: int = Field(64, ge=1)
    """N (paper: 64)."""
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_response_tokens: int = Field(3072, ge=1)
    min_successes: int = Field(2, ge=1)
    """Questions with fewer verified successes (counted by `keep_rule`) are left out of the pool (paper: 2)."""
    keep_rule: Literal["distinct", "correct"] = "distinct"
    """How successes count against `min_successes`: `distinct` texts (the pool stores a text once, so this is what
    replay can draw) or every `correct` sample (the paper's rule)."""
    questions_per_chunk: int = Field(64, ge=1)
    """Questions per generation call; progress is saved after each chunk."""
    seed: int = 0
    run_id: str = "collect"

    @model_validator(mode="after")
    def _successes_fit_the_samples(self) -> CollectConfig:
        # Checked here, before `rlep collect` starts Ray and an engine: no question could reach the bar.
        if self.min_successes > self.samples_per_question:
            raise ValueError(
                f"collect.min_successes (--min-successes) is {self.min_successes} but only "
                f"{self.samples_per_question} sample(s) per question are drawn (--n), so no question could be kept: "
                "lower --min-successes or raise --n"
            )
        return self


class WandbConfig(StrictModel):
    """Weights & Biases run of `rlep train` / `rlep collect` (needs `pip install 'rlep[wandb]'`)."""

    project: str | None = None
    """W&B project to log to; None = no W&B (the default; `wandb` is then never imported)."""
    entity: str | None = None
    """W&B team or user; None = the logged-in account's default."""
    mode: Literal["online", "offline"] = "online"
    """`offline` writes the run under `dir` only (upload it later with `wandb sync`)."""
    dir: Path | None = None
    """Folder W&B writes its `wandb/` run folders in; None = the run's directory (see `tensorboard_dir`), else
    W&B's default (./wandb)."""


class LoggingConfig(StrictModel):
    """Experiment tracking: every step record also goes to TensorBoard and, when asked, W&B (docs/tracking.md)."""

    tensorboard: bool = True
    """Write each step record as TensorBoard scalars (JSONL names, nested fields joined by `/`)."""
    tensorboard_dir: Path | None = None
    """Event file folder; None = `<run dir>/tensorboard`, the run's directory being `checkpoint.dir`, else the
    folder of `log_file` (where the JSONL goes); with neither set, no TensorBoard files. `rlep collect` writes
    to its `collect/` subfolder."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases, off unless `project` is set."""
    generations_per_step: int = Field(4, ge=0)
    """Sampled responses logged per step for a person to read (question, response, reward, fresh or replayed) to
    `<run dir>/generations.jsonl` and as a TensorBoard / W&B table (`generations`); 0 = none."""


# The attention and MLP projections of Llama, Qwen2 and Mistral-like decoders.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(StrictModel):
    """Beyond the reference (off by default): train PEFT LoRA adapters instead of every weight (docs/lora.md).
    Rollout is pushed, and checkpoints exported, merged weights W + (alpha / rank) B A under the base model's names."""

    rank: int = Field(0, ge=0)
    """r, the adapters' rank; 0 = no LoRA: every weight trains (the recipe)."""
    alpha: float = Field(16.0, gt=0)
    """lora_alpha: the update B A is scaled by alpha / rank."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Names (last component) of the linear layers that get an adapter; default: the attention and MLP projections
    of Llama / Qwen2. Only linear layers: an embedding or head named here is refused at start."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training. Above 0 the update's forward differs from the old-logprob
    pass (run without dropout), so the PPO ratio no longer starts at exactly 1."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _settings_need_a_rank(self) -> LoraConfig:
        # Compared with the defaults, not with what was given: the config reaches the learner's Ray actors as a
        # full dump, where every field counts as given.
        defaults = LoraConfig.model_construct()
        changed = [
            name for name in ("alpha", "target_modules", "dropout") if getattr(self, name) != getattr(defaults, name)
        ]
        if self.rank == 0 and changed:
            raise ValueError(
                f"lora.rank is 0, which means no LoRA (every weight trains), but lora.{', lora.'.join(changed)} "
                f"{'is' if len(changed) == 1 else 'are'} set: set lora.rank (e.g. 8) to train adapters, or drop them"
            )
        return self


class TrainConfig(StrictModel):
    run_id: str = "rlep"
    model: str = "tiny"
    """Starting checkpoint: an HF directory or a tiny-model preset name."""
    seed: int = 0
    steps: int = Field(100, ge=0)
    replay_pool: str = "rlep"
    """Pool of phase-1 successes in the replay service (read when M > 0; written by online replay)."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimConfig = OptimConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning; off (rank 0) by default."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    endpoints: EndpointsConfig = EndpointsConfig()
    local: LocalServicesConfig = LocalServicesConfig()
    verifier: ScorerSettings = ScorerSettings()
    """Scorers of the verifier this run starts (`scorers`, `default_scorer`, `scorer_path`: docs/rewards.md); a
    verifier at `endpoints.verifier` has its own, so setting both is refused."""
    data: DataConfig = DataConfig()
    eval: PeriodicEvalConfig = PeriodicEvalConfig()
    weight_sync: WeightSyncConfig = AutoSyncConfig()
    """How each step's new weights reach the rollout replicas: `transport` auto, stream, shared_file or nccl
    (services/weights/config.py); replicas that rejoin are brought up by auto."""
    collect: CollectConfig = CollectConfig()
    """Settings of `rlep collect` when it is given this file (`configs/recipes/collect.yaml`)."""
    tools: ToolUseConfig | None = None
    """Multi-turn episodes with a sandboxed Python tool (issue 50, `tool_rollouts.ToolUseConfig`); None: one answer."""
    log_file: Path | None = None
    """JSONL log, one line per step (None = <checkpoint dir>/log.jsonl or no file)."""
    logging: LoggingConfig = LoggingConfig()
    """TensorBoard and Weights & Biases copies of the step log."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus /metrics of the learner (9464 in deployments)."""
    metrics_host: str = "127.0.0.1"
    """Bind address of /metrics (0.0.0.0 in containers)."""
    metrics_linger_s: float = Field(0.0, ge=0, le=3600)
    """After the last step, keep /metrics up this long, so that Prometheus scrapes a short job's final figures:
    more than one scrape interval (the compose file sets 30 s against Prometheus' 15 s)."""
    metrics_tls: TlsFiles = TlsFiles()
    """Certificate and key of /metrics: with both set it serves HTTPS only (as every service's port can)."""

    @model_validator(mode="after")
    def _scorers_reach_the_verifier(self) -> TrainConfig:
        if self.endpoints.verifier and self.verifier != ScorerSettings():
            raise ValueError(
                f"verifier ({', '.join(sorted(self.verifier.model_fields_set))}) configures the verifier this run "
                f"starts, but endpoints.verifier={self.endpoints.verifier} is used instead: set the scorers in that "
                "verifier's own config (rlep serve verifier --set scorers...), or leave endpoints.verifier empty"
            )
        return self

    @model_validator(mode="after")
    def _mini_batches_fit(self) -> TrainConfig:
        if self.algorithm.mini_batch_questions > self.algorithm.questions_per_step:
            raise ValueError("algorithm.mini_batch_questions cannot exceed algorithm.questions_per_step")
        if self.algorithm.overlong_buffer_tokens > self.algorithm.max_response_tokens:
            raise ValueError("algorithm.overlong_buffer_tokens cannot exceed algorithm.max_response_tokens")
        sync, tensor_parallel = self.weight_sync, self.local.rollout_engine.tensor_parallel_size
        started_here = not (self.endpoints.rollout or self.endpoints.rollout_service)
        workers = getattr(sync, "workers_per_replica", None)
        if started_here and workers is not None and workers != tensor_parallel:
            raise ValueError(
                f"weight_sync.workers_per_replica={workers} but the replicas this run starts have "
                f"tensor_parallel_size={tensor_parallel} workers each: leave workers_per_replica unset"
            )
        gpus, processes = self.local.learner_gpus, self.deepspeed.num_processes
        if gpus is not None and 0 < gpus < 1 and processes > 1:
            raise ValueError(
                f"local.learner_gpus={gpus} would put {processes} learner processes on shared GPUs, which NCCL refuses "
                "(Duplicate GPU detected): give each process a whole GPU (learner_gpus: 1) or use one process"
            )
        algo = self.algorithm
        if algo.correction != "none" and algo.temperature == 0:
            raise ValueError(
                f"algorithm.behavior_correction={algo.behavior_correction} needs temperature > 0: greedy decoding has "
                "no sampling distribution to weight by"
            )
        return self
