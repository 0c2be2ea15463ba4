"""The learner's paths that tests/gpu leaves out, each checked on one GPU in a process of its own: LoRA, ZeRO-3 with a
KL reference, optimizer offload, the micro-batches' token budget, an untied head, the tensors a broadcast sends,
`save_hf` reloaded by transformers, and a ZeRO-3 checkpoint round trip. Run by scripts/gpu-check.sh; a script, not a
pytest module, so that every case's figures (time, peak memory, statistics) reach the report whether it passes or not.

    python tests/gpu/paths_probe.py --out paths.json [--cases lora,offload] [--jobs 3] [--cpu]

Each case runs `update_probe.py` (one update of the tiny model's fp32 or bf16 weights) and states checks against
`reference`, the plain fp32 ZeRO-2 update: a path that computes the same update must land within 1e-2 of it (relative
L2 gap of the weight change, the bound tests/gpu uses between CUDA and the CPU). `--cpu` hides CUDA (the checks then
expect the CPU): how this script is kept working where no GPU is. Exit code 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root, for tests.gpu
from tests.gpu.test_learner_cuda import relative_change_gap  # noqa: E402

PROBE = Path(__file__).with_name("update_probe.py")
CASE_TIMEOUT_S = 300
SAME_UPDATE_GAP = 1e-2  # as tests/gpu: fp32 kernels sum in other orders, the Adam steps agree to well under 1%
LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class Case:
    flags: tuple[str, ...]
    check: Callable[[dict, dict | None, Path], dict[str, bool]]
    untied: bool = False  # the tiny model with its own head instead of the embedding's
    resume: tuple[str, ...] = ()  # flags of a second process that loads the first one's checkpoint


def moved(run: dict) -> bool:
    return any(not torch.equal(run["final"][k], run["initial"][k]) for k in run["final"])


def finite(stats: dict) -> bool:
    return all(torch.isfinite(torch.tensor(v)).item() for v in stats.values())


def same_update(run: dict, reference: dict | None) -> bool:
    return reference is not None and relative_change_gap(run, reference) < SAME_UPDATE_GAP


def check_token_budget(run, reference, scratch):
    return {"same_update_as_reference": same_update(run, reference), "finite_stats": finite(run["stats"])}


def check_offload(run, reference, scratch):
    return {"same_update_as_reference": same_update(run, reference), "adam_on_host": run["adam"] != "deepspeed_fused"}


def check_zero3_kl(run, reference, scratch):
    mask = run["loss_mask"].bool()
    old, ref, after = run["old_logprobs"][mask], run["ref_logprobs"][mask], run["after_logprobs"][mask]
    return {
        "reference_equals_the_start": bool((ref - old).abs().max() < 1e-4),
        "reference_frozen": torch.equal(run["ref_after"], run["ref_logprobs"]),
        "policy_moved": bool((after - old).abs().max() > 1e-4),
        # The first update's second mini-batch is scored after one step, the second update's after two and three.
        "kl_grows_as_the_policy_moves": 0 < run["stats"]["kl_ref"] < run["second_stats"]["kl_ref"],
    }


def check_lora(run, reference, scratch):
    from rlep.services.learner.config import LORA_TARGETS

    def adapted(name: str) -> bool:
        return name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in LORA_TARGETS

    changed = {k for k in run["final"] if not torch.equal(run["final"][k], run["initial"][k])}
    return {
        "merged_names_as_plain": reference is not None and run["final"].keys() == reference["final"].keys(),
        "only_adapted_weights_moved": bool(changed) and all(adapted(k) for k in changed),
        "finite_stats": finite(run["stats"]),
    }


def check_save_hf(run, scratch: Path) -> dict[str, bool]:
    """The bf16 run's export reloads through transformers with the trained weights, in bf16 (the training dtype)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(scratch / "hf").state_dict()
    return {
        "save_hf_reloads_the_trained_weights": all(
            torch.equal(reloaded[k], v.to(reloaded[k].dtype)) for k, v in run["final"].items()
        ),
        "save_hf_in_training_dtype": all(v.dtype == torch.bfloat16 for v in reloaded.values()),
    }


def check_untied(run, reference, scratch):
    final = run["final"]
    return {
        "own_head_moved": "lm_head.weight" in final
        and not torch.equal(final["lm_head.weight"], run["initial"]["lm_head.weight"]),
        "head_apart_from_embedding": not torch.equal(final["lm_head.weight"], final["model.embed_tokens.weight"]),
        **check_save_hf(run, scratch),
    }


def check_zero3_broadcast(run, reference, scratch):
    sent, manifest, final = run["device_weights"]["sent"], run["device_weights"]["manifest"], run["final"]
    device = run["device"].split(":")[0]
    return {
        "names_in_state_dict_order": [name for name, *_ in sent] == list(final),
        "manifest_names": [name for name, *_ in manifest] == list(final),
        "on_the_training_device": all(d.split(":")[0] == device for _, d, _, _ in sent),
        "in_the_checkpoint_dtype": all(dtype == final[name].dtype for name, _, dtype, _ in sent),
        "values_of_the_state_dict": all(torch.equal(t, final[name]) for name, _, _, t in sent),
        **check_save_hf(run, scratch),
    }


def check_zero3_checkpoint(run, reference, scratch):
    first = torch.load(scratch / "first.pt", weights_only=False)
    same_rng = all(torch.equal(run["rng_after_load"][k], first["rng_at_save"][k]) for k in first["rng_at_save"])
    return {
        "zero3_update_same_as_reference": same_update(first, reference),
        "weights_resumed": all(
            torch.allclose(run["initial"][k], v, atol=1e-6, rtol=0) for k, v in first["final"].items()
        ),
        "rng_resumed": same_rng,
        "second_update_trains": moved(run) and finite(run["stats"]),
    }


CASES: dict[str, Case] = {
    "reference": Case(("--stage", "2"), lambda run, reference, scratch: {"trains": moved(run)}),
    "token_budget": Case(("--stage", "2", "--micro-batch-tokens", "16"), check_token_budget),
    "offload": Case(("--stage", "2", "--offload"), check_offload),
    "zero3_kl": Case(("--stage", "3", "--kl-coef", "0.1"), check_zero3_kl),
    "lora": Case(("--stage", "2", "--lora", "4"), check_lora),
    "untied_head": Case(("--stage", "2", "--bf16", "--save-hf", "{scratch}/hf"), check_untied, untied=True),
    "zero3_broadcast_save_hf": Case(
        ("--stage", "3", "--bf16", "--device-weights", "--save-hf", "{scratch}/hf"), check_zero3_broadcast
    ),
    "zero3_checkpoint": Case(
        ("--stage", "3", "--save-checkpoint", "{scratch}/ckpt"),
        check_zero3_checkpoint,
        resume=("--stage", "3", "--load-checkpoint", "{scratch}/ckpt"),
    ),
}


class ChildFailed(Exception):
    pass


def run_child(model_dir: Path, out: Path, flags: tuple[str, ...], scratch: Path, cpu: bool) -> None:
    """`update_probe.py` in a process of its own; raises ChildFailed with the tail of its output when it fails."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if cpu else dict(os.environ)
    command = [sys.executable, str(PROBE), str(model_dir), str(out), *(f.format(scratch=scratch) for f in flags)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise ChildFailed(f"timed out after {CASE_TIMEOUT_S} s", str(error.stderr or "")) from None
    if done.returncode != 0:
        raise ChildFailed(f"exit code {done.returncode}", done.stdout + done.stderr)


def run_case(name: str, model_dir: Path, scratch: Path, cpu: bool) -> dict:
    """Runs one case's process (two for a checkpoint round trip); its figures, or how it failed."""
    case, started = CASES[name], time.perf_counter()
    scratch.mkdir(parents=True)
    try:
        if case.resume:
            run_child(model_dir, scratch / "first.pt", case.flags, scratch, cpu)
        run_child(model_dir, scratch / "out.pt", case.resume or case.flags, scratch, cpu)
    except ChildFailed as failure:
        reason, log = failure.args
        return {"ok": False, "error": reason, "log_tail": log.splitlines()[-LOG_TAIL_LINES:],
                "seconds": time.perf_counter() - started}  # fmt: skip
    return {"seconds": time.perf_counter() - started}


def judge(name: str, figures: dict, scratch: Path, reference: dict | None, cpu: bool) -> dict:
    """Adds a finished case's checks and figures to `figures`; `ok` when every check holds."""
    if "error" in figures:
        return figures
    run = torch.load(scratch / "out.pt", weights_only=False)
    checks = {"on_the_expected_device": run["device"].startswith("cpu" if cpu else "cuda")}
    try:
        checks |= CASES[name].check(run, reference, scratch)
    except Exception as error:  # a check that cannot be computed fails the case, with the reason
        figures["error"] = f"check raised {type(error).__name__}: {error}"
    figures |= {
        "ok": "error" not in figures and all(checks.values()),
        "checks": checks,
        "device": run["device"],
        "adam": run["adam"],
        "build_s": run["build_s"],
        "update_s": run["update_s"],
        "peak_gib": run["peak_bytes"] / 2**30,
        "stats": run["stats"],
        **({"second_stats": run["second_stats"]} if "second_stats" in run else {}),
    }
    return figures


def write_report(path: Path, results: dict) -> None:
    cuda = torch.cuda.is_available()
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "failed": sorted(name for name, f in results.items() if not f.get("ok")),
        "cases": results,
    }
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON report, rewritten as each case ends")
    parser.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    parser.add_argument("--jobs", type=int, default=3, help="cases run at once, after the reference")
    parser.add_argument("--cpu", action="store_true", help="hide CUDA: run every case on the CPU")
    args = parser.parse_args(argv)
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = set(names) - CASES.keys()
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {list(CASES)}")
    from rlep.common.tiny_model import ModelSpec, cached_model

    models = {False: cached_model("tiny"), True: cached_model(ModelSpec(tie_word_embeddings=False))}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="paths_probe.") as tmp:
        scratch = Path(tmp)

        def finish(name: str, reference: dict | None) -> None:
            figures = run_case(name, models[CASES[name].untied], scratch / name, args.cpu)
            results[name] = judge(name, figures, scratch / name, reference, args.cpu)
            print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']:.0f} s)", flush=True)
            write_report(args.out, results)  # each case as it ends: a step cut short keeps the finished ones

        finish("reference", None)  # first: the other cases compare with it
        reference_out = scratch / "reference" / "out.pt"
        reference = torch.load(reference_out, weights_only=False) if reference_out.exists() else None
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(lambda name: finish(name, reference), [n for n in names if n != "reference"]))
    for name, figures in results.items():
        if not figures["ok"]:
            failed = [k for k, v in figures.get("checks", {}).items() if not v]
            print(f"{name}: {figures.get('error') or 'checks failed: ' + ', '.join(failed)}", file=sys.stderr)
            print("\n".join(figures.get("log_tail", [])), file=sys.stderr)
    return 0 if all(f["ok"] for f in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
