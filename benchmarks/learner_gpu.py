"""The learner's update next to a hand-written PyTorch loop on one batch: time, tokens/s, MFU, peak memory.

Both sides train one random-weight Qwen2 model (saved once under ~/.cache/rlep/bench-models/<shape>) on one
synthetic batch (seeded random tokens, response lengths uniform in 1..max) with the policy's mini-batches
(its shuffle) and micro-batches (its plan, micro_batch_plan.py), grad clip and AdamW. One step = 2 mini-batches.
- `project`: `DeepSpeedPolicy` built without Ray, as one learner process builds it: `policy.logprobs` (the
  old-logprob pass), `policy.update`, `policy.state_dict()` (the full-weight gather).
- `raw`: HF `AutoModelForCausalLM` + `torch.optim.AdamW` (fused on CUDA), full-vocabulary float32 log-softmax
  (`token_logprobs`), the project's `policy_loss`. Under `deepspeed.dtype=bf16` its weights stay float32 and
  the forward runs under bf16 autocast, as DeepSpeed keeps float32 master weights (bare bf16 weights would
  round lr-1e-6 updates away). It computes no entropy; the project's update does, for its statistics.

Each side runs in its own subprocess of this script, raw first: each peak memory is that side's own
(`torch.cuda.max_memory_allocated` over old-logprob passes and updates; on CPU `ru_maxrss`, the peak of the
side's whole process, loading included), no allocator cache or DeepSpeed global state crosses over, and a
side that runs out of memory is recorded as failed without losing the other's figures.

Figures are warm: one untimed call, then the median of `--repeats` timed calls (synchronised on CUDA).
tokens/s counts real tokens (attention mask, not padding). MFU = 6 * N * tokens (* 4/3 with gradient
checkpointing, for the recomputed forward) / seconds / peak FLOP/s, N the parameters that multiply (not the
input embedding; a tied head once), attention scores left out. The weight change is the L2 norm of the change
of the float32 (master) weights over every `WEIGHT_SAMPLE_STRIDE`-th element, warm-up step included.

    python benchmarks/learner_gpu.py --shape 0.5b
    python benchmarks/learner_gpu.py --shape 1.5b --set deepspeed.zero_stage=3 --set optim.micro_batch_tokens=16384
    python benchmarks/learner_gpu.py --shape 7b   # ZeRO-3 + optimizer offload, project side only
    python benchmarks/learner_gpu.py --tiny --out /tmp/tiny.json   # CPU, in CI
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from synthetic_batch import synthetic_batch  # benchmarks/, the script's own directory

from rlep.common.config import load_config
from rlep.services.learner.algorithm import mini_batch_normalizer, policy_loss
from rlep.services.learner.batch import ExperienceBatch, mini_batches, token_logprobs
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.micro_batch_plan import plan_micro_batches

MODEL_CACHE = Path.home() / ".cache" / "rlep" / "bench-models"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SIDES = ("raw", "project")
MINI_BATCHES = 2  # per step
WEIGHT_SAMPLE_STRIDE = 16  # a 1/16 float32 copy of the weights: 2 GB for 7B, so the change fits in host memory
LOG_TAIL_LINES = 40


def qwen2(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied: bool) -> dict:
    """`Qwen2Config` fields of a model shape."""
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "vocab_size": vocab,
            "tie_word_embeddings": tied}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    model: dict[str, Any]  # Qwen2Config fields
    rows: int
    prompt_tokens: int
    max_response_tokens: int
    micro_batch: int
    gpu: bool = True  # bf16 and gradient checkpointing by default
    sets: tuple[str, ...] = ()  # the shape's default --set overrides
    sides: tuple[str, ...] = SIDES


SHAPES = {
    "tiny": Shape(qwen2(64, 2, 4, 2, 128, 512, True), 8, 16, 48, 2, gpu=False),
    "0.5b": Shape(qwen2(896, 24, 14, 2, 4864, 151936, True), 64, 512, 2048, 8),
    "1.5b": Shape(qwen2(1536, 28, 12, 2, 8960, 151936, True), 32, 1024, 3072, 4),
    # Raw 7B needs 16 bytes per parameter (float32 weights, grads, AdamW): 122 GB, more than one GPU holds.
    "7b": Shape(qwen2(3584, 28, 28, 4, 18944, 152064, False), 32, 1024, 3072, 4, sides=("project",),
                sets=("deepspeed.zero_stage=3", "deepspeed.offload_optimizer=true")),
}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="0.5b")
    parser.add_argument("--tiny", action="store_true", help="the CPU shape (same as --shape tiny)")
    parser.add_argument("--set", action="append", default=[], help="TrainConfig override, e.g. deepspeed.zero_stage=3")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="on both sides (default: on for GPU shapes, off for tiny)")  # fmt: skip
    parser.add_argument("--repeats", type=int, help="timed calls (default 3 on GPU shapes, 1 for tiny)")
    parser.add_argument("--rows", type=int, help="rows of the batch (default: the shape's)")
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--max-response-tokens", type=int)
    parser.add_argument("--sides", nargs="+", choices=SIDES, help="default: both (7b: project)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak TFLOP/s (default: H100 bf16 dense)")
    parser.add_argument("--out", type=Path, help="JSON report (default benchmarks/results/learner_gpu_<shape>.json)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # set in a child process: run one side
    parser.add_argument("--side-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.shape = "tiny" if args.tiny else args.shape
    shape = SHAPES[args.shape]
    args.rows = args.rows or shape.rows
    if args.rows < MINI_BATCHES:
        parser.error(f"--rows must be at least {MINI_BATCHES}: a step is {MINI_BATCHES} mini-batches")
    args.prompt_tokens = args.prompt_tokens or shape.prompt_tokens
    args.max_response_tokens = args.max_response_tokens or shape.max_response_tokens
    args.repeats = args.repeats or (3 if shape.gpu else 1)
    args.sides = args.sides or list(shape.sides)
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = shape.gpu
    args.out = args.out or RESULTS_DIR / f"learner_gpu_{args.shape}.json"
    return args


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The project's `TrainConfig` of this run; both sides take their hyperparameters from it."""
    shape = SHAPES[args.shape]
    base = {
        "model": str(MODEL_CACHE / args.shape),
        "algorithm": {"questions_per_step": 1, "mini_batch_questions": 1, "fresh_per_question": args.rows},
        "optim": {"lr": 1e-6, "warmup_steps": 0, "micro_batch_size": shape.micro_batch, "grad_clip": 1.0},
        "deepspeed": {"dtype": "bf16" if shape.gpu else "fp32", "zero_stage": 2,
                      "gradient_checkpointing": args.gradient_checkpointing},
    }  # fmt: skip
    # A --set replaces one field, not its section; the command line's come last and win.
    return load_config(TrainConfig, base, sets=[*shape.sets, *args.set])


def ensure_model(name: str) -> Path:
    """The random-weight checkpoint of shape `name`: created (seeded) and saved on first use."""
    shape, model_dir = SHAPES[name], MODEL_CACHE / name
    if model_dir.exists():
        saved = json.loads((model_dir / "config.json").read_text())
        if any(saved.get(key) != value for key, value in shape.model.items()):
            raise SystemExit(f"{model_dir} holds another shape than {name!r}: delete it to rebuild it")
        return model_dir
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**shape.model, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if shape.gpu else torch.float32)
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=MODEL_CACHE))
    model.save_pretrained(partial)
    partial.rename(model_dir)  # atomic: a half-written directory is never taken for the model
    return model_dir


def random_lengths(args: argparse.Namespace, seed: int) -> list[int]:
    """`args.rows` response lengths in [1, `args.max_response_tokens`]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, args.max_response_tokens + 1, (args.rows,), generator=generator).tolist()


class RawLoop:
    """The hand-written reference: an HF model, torch AdamW, full-vocabulary logprobs and the project's loss.

    `logprobs` / `update` take and return what `DeepSpeedPolicy`'s do; the mini-batch order comes from a
    generator seeded as the policy's and micro-batches from the policy's plan, so both run the same passes.
    """

    def __init__(self, model_dir: Path, config: TrainConfig, device: torch.device):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(config.seed)
        self.config, self.device = config, device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        if config.deepspeed.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optim = config.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay, fused=device.type == "cuda")  # fmt: skip
        self.shuffle = torch.Generator().manual_seed(config.seed + 1)  # as DeepSpeedPolicy's

    def _logprobs(self, sub: ExperienceBatch) -> torch.Tensor:
        """`[n, l-1]` float32 logprobs of a micro-batch's next tokens, on the device."""
        tokens = sub.tokens.to(self.device)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.config.deepspeed.dtype == "bf16"):
            out = self.model(input_ids=tokens, attention_mask=sub.attention_mask.to(self.device), use_cache=False)
        return token_logprobs(out.logits, tokens)

    def _micro_batches(self, batch: ExperienceBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """The policy's micro-batches of `rows` for one process (micro_batch_plan.py)."""
        optim, lengths = self.config.optim, batch.attention_mask.sum(dim=1)
        budget = getattr(optim, "micro_batch_tokens", None)
        return [micro for micro, _ in plan_micro_batches(rows, lengths, 0, 1, optim.micro_batch_size, budget)]

    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        with torch.no_grad():
            for rows in self._micro_batches(batch, torch.arange(batch.size)):
                sub = batch.select(rows)
                out[rows, : sub.loss_mask.shape[1]] = self._logprobs(sub).cpu()
        return out

    def update(self, batch: ExperienceBatch, rows_per_mini_batch: int) -> dict[str, float]:
        """One step: mini-batches as the policy makes them; the mean mini-batch loss and the last grad norm."""
        self.model.train()
        count = max(1, round(batch.size / rows_per_mini_batch))
        results = [
            self._train_mini_batch(batch, mini)
            for _ in range(self.config.algorithm.ppo_epochs)
            for mini in mini_batches(batch.size, count, self.shuffle)
        ]
        return {"loss": statistics.fmean(loss for loss, _ in results), "grad_norm": results[-1][1]}

    def _train_mini_batch(self, batch: ExperienceBatch, mini: torch.Tensor) -> tuple[float, float]:
        """Accumulates the mini-batch's gradient over its micro-batches, clips it, steps; (loss, grad norm)."""
        algo, device = self.config.algorithm, self.device
        normalizer = mini_batch_normalizer(batch.loss_mask[mini], algo.loss_agg)
        total = 0.0
        for rows in self._micro_batches(batch, mini):
            sub = batch.select(rows)
            loss, _ = policy_loss(self._logprobs(sub), sub.old_logprobs.to(device), sub.advantages.to(device),
                                  sub.loss_mask.to(device), algo.loss_settings, normalizer=normalizer)  # fmt: skip
            loss.backward()
            total += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, float(grad_norm)


def measure(fn: Callable[[], Any], repeats: int, cuda: bool) -> tuple[list[float], Any]:
    """One untimed warm-up call, then `repeats` timed ones: (seconds of each, the last result)."""
    sync = torch.cuda.synchronize if cuda else lambda: None
    result, seconds = fn(), []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        result = fn()
        sync()
        seconds.append(time.perf_counter() - started)
    return seconds, result


def weight_sample(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """Every `WEIGHT_SAMPLE_STRIDE`-th element of each weight, as one flat float32 CPU tensor."""
    return torch.cat([w.detach().float().reshape(-1)[::WEIGHT_SAMPLE_STRIDE].cpu() for w in weights])


def build_side(side: str, config: TrainConfig) -> tuple[Any, Any, Callable[[], Iterable], Callable[[], Any] | None]:
    """(trainer with `logprobs` / `update`, its HF model, its float32 weights, its full-weight gather or None)."""
    if side == "raw":
        raw = RawLoop(Path(config.model), config, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return raw, raw.model, raw.model.parameters, None
    import deepspeed

    from rlep.common.ports import free_port
    from rlep.services.learner.policy import DeepSpeedPolicy, init_distributed

    init_distributed(0, 1, "127.0.0.1", free_port())
    policy = DeepSpeedPolicy(Path(config.model), config)

    def masters():  # DeepSpeed's float32 master weights; the parameter itself where it keeps none
        for p in policy.hf_model.parameters():
            full = deepspeed.utils.safe_get_full_fp32_param(p)
            yield p if full is None else full

    return policy, policy.hf_model, masters, policy.state_dict


def measure_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """Builds one side, then times its old-logprob passes, updates and (project) full-weight gathers."""
    config, cuda = train_config(args), torch.cuda.is_available()
    started = time.perf_counter()
    trainer, model, masters, gather = build_side(side, config)
    load_s = time.perf_counter() - started
    batch = synthetic_batch(model.config.vocab_size, args.prompt_tokens, random_lengths(args, config.seed), config.seed)
    before = weight_sample(masters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    logprob_s, old_logprobs = measure(lambda: trainer.logprobs(batch), args.repeats, cuda)
    batch = batch.with_old_logprobs(old_logprobs)
    steps: list[dict[str, float]] = []  # every update's statistics, the warm-up's first
    update_s, _ = measure(lambda: steps.append(trainer.update(batch, batch.size // MINI_BATCHES)), args.repeats, cuda)
    if cuda:
        peak_gib, peak_kind = torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated"
    else:
        peak_gib, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "ru_maxrss (whole process)"
    gather_s = measure(gather, args.repeats, cuda)[0] if gather else None
    numel = {id(p): getattr(p, "ds_numel", p.numel()) for p in model.parameters()}  # ZeRO-3: partitioned
    embedding = 0 if model.config.tie_word_embeddings else numel[id(model.get_input_embeddings().weight)]
    epochs = config.algorithm.ppo_epochs
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "matmul_params": sum(numel.values()) - embedding,
        "tokens": int(batch.attention_mask.sum()) * epochs,
        "response_tokens": batch.response_tokens * epochs,
        "padded_tokens": batch.tokens.numel() * epochs,
        "load_s": load_s,
        "update_s": statistics.median(update_s),
        "update_s_all": update_s,
        "logprob_s": statistics.median(logprob_s),
        "logprob_s_all": logprob_s,
        "gather_s": statistics.median(gather_s) if gather_s else None,
        "peak_memory_gib": peak_gib,
        "peak_memory_kind": peak_kind,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "weight_change_l2": float((weight_sample(masters()) - before).norm()),
        "steps": steps,
        "imported": {name: name in sys.modules for name in ("ray", "vllm")},
    }


def run_child(side: str, argv: list[str], scratch: Path) -> dict[str, Any]:
    """Runs one side in a subprocess of this script: its figures, or its exit code and the tail of its log."""
    out, log = scratch / f"{side}.json", scratch / f"{side}.log"
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--side", side, "--side-out", str(out)]
    started = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
    print(f"{side}: exit code {code} after {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print("\n".join(tail), file=sys.stderr)
        return {"error": f"exit code {code}", "log_tail": tail}
    return json.loads(out.read_text())


def build_report(args: argparse.Namespace, config: TrainConfig, sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON report; adds tokens/s, MFU (None on CPU) and old-logprob / update time to each side's figures."""
    ok = {side: f for side, f in sides.items() if "error" not in f}
    for f in ok.values():
        f["tokens_per_s"] = f["tokens"] / f["update_s"]
        flops = 6 * f["matmul_params"] * f["tokens"] * (4 / 3 if config.deepspeed.gradient_checkpointing else 1)
        f["mfu"] = flops / f["update_s"] / (args.peak_tflops * 1e12) if f["device"] != "cpu" else None
        f["logprob_over_update"] = f["logprob_s"] / f["update_s"]

    def ratio(key: str) -> float | None:  # project / raw
        return ok["project"][key] / ok["raw"][key] if len(ok) == 2 else None

    return {
        "machine": {"device": next(iter(ok.values()))["device"] if ok else None,
                    "python": platform.python_version(), "platform": platform.platform()},
        "versions": {d.name: d.version for d in metadata.distributions() if d.name in ("torch", "transformers",
                                                                                       "deepspeed", "rlep")},
        "settings": {
            "shape": args.shape, "shape_fields": asdict(SHAPES[args.shape]), "rows": args.rows,
            "prompt_tokens": args.prompt_tokens, "max_response_tokens": args.max_response_tokens,
            "mini_batches": MINI_BATCHES, "repeats": args.repeats, "sets": args.set, "peak_tflops": args.peak_tflops,
            "weight_sample_stride": WEIGHT_SAMPLE_STRIDE,
            "config": config.model_dump(mode="json", include={"seed", "algorithm", "optim", "deepspeed"}),
        },
        "sides": sides,
        "ratio": {key: ratio(key) for key in ("tokens_per_s", "update_s", "peak_memory_gib", "logprob_s")},
    }  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    s = report["settings"]
    table = Table(title=f"learner update, {s['shape']} on {report['machine']['device']}: {s['rows']} rows, "
                        f"prompt {s['prompt_tokens']} + response <= {s['max_response_tokens']} tokens")  # fmt: skip
    for name in ("side", "update s", "tokens/s", "MFU", "peak GiB", "old-logprob s", "logprob / update",
                 "gather s", "weight change", "loss"):  # fmt: skip
        table.add_column(name, justify="left" if name == "side" else "right")
    for side, f in report["sides"].items():
        if "error" in f:
            table.add_row(side, f"failed ({f['error']})")
            continue
        table.add_row(side, fmt(f["update_s"], ".3f"), fmt(f["tokens_per_s"], ",.0f"), fmt(f["mfu"], ".1%"),
                      fmt(f["peak_memory_gib"], ".2f"), fmt(f["logprob_s"], ".3f"),
                      fmt(f["logprob_over_update"], ".2f"), fmt(f["gather_s"], ".3f"),
                      fmt(f["weight_change_l2"], ".3g"), fmt(f["steps"][-1]["loss"], ".4f"))  # fmt: skip
    r = report["ratio"]
    table.add_row("project / raw", fmt(r["update_s"], ".2f"), fmt(r["tokens_per_s"], ".2f"),
                  fmt(r["tokens_per_s"], ".2f"), fmt(r["peak_memory_gib"], ".2f"), fmt(r["logprob_s"], ".2f"),
                  style="bold")  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # a pipe would get 80 columns


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.side:  # a child: one side, figures to --side-out
        args.side_out.write_text(json.dumps(measure_side(args.side, args)))
        return 0
    config = train_config(args)  # a bad --set fails here, before any model is built
    ensure_model(args.shape)
    with tempfile.TemporaryDirectory(prefix="learner_gpu.") as scratch:
        sides = {side: run_child(side, argv, Path(scratch)) for side in SIDES if side in args.sides}
    report = build_report(args, config, sides)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if any("error" in f for f in sides.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
