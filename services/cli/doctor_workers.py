"""The heavy halves of `rlep doctor` (services/cli/doctor.py), each run in a process of its own.

    python -m rlep.services.cli.doctor_workers JOB '{"model": "DIR", ...}' RESULT.json

One job per process, so that DeepSpeed's process group and environment, vLLM's engine and a
communicator's group never reach the doctor's process, and a crash or hang is contained. A job writes
`{"ok": bool, "detail": str, "values": {...}}` to RESULT.json; an exception is left to print its
traceback on stderr, whose last lines the doctor shows. Jobs:

- `learner`: one PPO update with the project's `DeepSpeedPolicy` on a synthetic batch (the GPU that
  CUDA_VISIBLE_DEVICES leaves visible, else the CPU).
- `rollout`: a rollout replica as a run starts it (vLLM engine + gRPC server), a greedy generate, a
  push of deterministically perturbed weights, and its logprobs against the learner's reference.
- `broadcast-send` / `broadcast-receive`: the learner's `WeightSender` and a rollout worker's receiving
  side of the weight broadcast (NCCL between two GPUs, else gloo), on the model's weights.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

# Relative size of the perturbation pushed to the replica: large enough that the served logprobs move far beyond
# ROLLOUT_TOLERANCE (the check must be able to fail), small enough to keep the model's activations in range.
PERTURBATION = 0.5
# Max |served - reference| logprob over the generated tokens. vLLM serves a float32 checkpoint in bfloat16 by
# default (dtype auto, CPU and GPU): 8 significand bits, ~0.4% relative error in weights and activations. On the
# tiny model that measured ~0.004 nats (at start and after the push) against 0.34 before the push; 7B-class models
# in bfloat16 commonly differ from float32 by a few 0.01. 0.1 leaves room for that and stays below a real change.
ROLLOUT_TOLERANCE = 0.1
GREEDY_TOKENS = 16
PROMPT_TEXT = "Q: 12+30=?\nA: "


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's *.safetensors files, under its own names and dtypes."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {model_dir}: not a Hugging Face checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def perturbed(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Each tensor plus Gaussian noise of PERTURBATION times its own scale (mean |x|), same dtype; deterministic."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in tensors.items():
        base = tensor.float()
        scale = PERTURBATION * float(base.abs().mean().clamp_min(1e-3))
        out[name] = (base + scale * torch.randn(base.shape, generator=generator)).to(tensor.dtype).contiguous()
    return out


def state_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 over the tensors' bytes, in order (what both ends of a broadcast compare)."""
    import hashlib

    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


# -- learner -----------------------------------------------------------------------------------
def synthetic_batch(vocab: int):
    """2 questions x 4 random responses, rewards +-1 (so every group has non-zero advantages)."""
    from rlep.common.types import Group, Trajectory
    from rlep.services.learner.batch import build_batch

    generator = torch.Generator().manual_seed(0)

    def ids(count: int) -> tuple[int, ...]:
        return tuple(int(t) for t in torch.randint(2, vocab, (count,), generator=generator))

    groups = []
    for q in range(2):
        prompt = ids(6)
        rows = [
            Trajectory(f"q{q}", f"r{k}", 1.0 if k % 2 else -1.0, prompt_token_ids=prompt, response_token_ids=ids(8 + k))
            for k in range(4)
        ]
        groups.append(Group(f"q{q}", "1", rows))
    return build_batch(groups, pad_id=0)


def learner(model: str) -> dict:
    """One update of the real policy; passes when its statistics are finite and every weight tensor moved."""
    from rlep.common.ports import free_port
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.deepspeed_setup import init_distributed
    from rlep.services.learner.policy import DeepSpeedPolicy

    device = f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    init_distributed(0, 1, "127.0.0.1", free_port())
    # lr 1e-3 without weight decay: every tensor that gets a gradient moves by ~lr in Adam's first step,
    # visibly in float32, and nothing moves without a gradient.
    config = TrainConfig.model_validate(
        {
            "model": model,
            "algorithm": {"questions_per_step": 2, "mini_batch_questions": 2, "fresh_per_question": 4},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0, "micro_batch_size": 4},
        }
    )
    policy = DeepSpeedPolicy(Path(model), config)
    load_s = time.perf_counter() - started
    before = policy.state_dict()
    batch = synthetic_batch(int(policy.hf_model.config.vocab_size))
    started = time.perf_counter()
    batch = batch.with_old_logprobs(policy.logprobs(batch))
    stats = policy.update(batch, rows_per_mini_batch=batch.size)
    update_s = time.perf_counter() - started
    after = policy.state_dict()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    largest = max(float((after[k].float() - before[k].float()).abs().max()) for k in before)
    infinite = sorted(k for k, v in stats.items() if not math.isfinite(v))
    ok = not infinite and not unchanged
    detail = (
        f"{device}: loss {stats['loss']:+.4f}, entropy {stats['entropy']:.3f}, "
        f"{len(before) - len(unchanged)}/{len(before)} tensors moved (max |dw| {largest:.1e})"
    )
    if infinite:
        detail += f"; non-finite statistics: {', '.join(infinite)}"
    if unchanged:
        detail += f"; unchanged after the update: {', '.join(unchanged[:3])}"
    values = {
        "load_s": load_s,
        "update_s": update_s,
        "max_weight_change": largest,
        "tensors": len(before),
        "tensors_moved": len(before) - len(unchanged),
        **stats,
    }
    return {"ok": ok, "detail": detail, "values": values}


# -- rollout -----------------------------------------------------------------------------------
class Reference:
    """The learner's side of the comparison: a transformers forward in float32 on the CPU, scored with the
    learner's full-vocabulary `token_logprobs`."""

    def __init__(self, model: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(self, weights: dict[str, torch.Tensor], prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """`[len(tokens)]` logprob of each of `tokens` after `prompt` under `weights` (checkpoint names)."""
        from rlep.services.learner.batch import token_logprobs

        result = self.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"checkpoint tensors transformers does not know: {result.unexpected_keys[:3]}")
        sequence = torch.tensor([prompt + tokens])
        scores = token_logprobs(self.model(input_ids=sequence).logits, sequence)  # [1, L-1]
        return scores[0, len(prompt) - 1 :]


def greedy(client, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """The replica's greedy continuation of `prompt` and its logprob of each generated token."""
    from rlep.services.rollout.types import Sampling

    [completion] = client.generate([prompt], Sampling(n=1, temperature=0.0, max_tokens=GREEDY_TOKENS))
    [sample] = completion.samples
    if not sample.token_ids:
        raise RuntimeError("the replica generated no token")
    return list(sample.token_ids), torch.tensor(sample.logprobs)


def compare_served(client, reference: Reference, prompt: list[int], original, pushed) -> dict:
    """Max |served - reference| logprob: the checkpoint as loaded, and before and after pushing `pushed`."""
    tokens, served = greedy(client, prompt)
    loaded = float((served - reference.logprobs(original, prompt, tokens)).abs().max())
    before = float((served - reference.logprobs(pushed, prompt, tokens)).abs().max())
    started = time.perf_counter()
    client.push_weights(pushed, version=1)  # the run's default transport: shared memory here, else streamed
    push_s = time.perf_counter() - started
    versions = client.versions()
    tokens, served = greedy(client, prompt)
    after = float((served - reference.logprobs(pushed, prompt, tokens)).abs().max())
    return {
        "max_diff_loaded": loaded,
        "max_diff_before": before,
        "max_diff_after": after,
        "push_s": push_s,
        "versions": versions,
        "tokens": len(tokens),
    }


def served_problems(values: dict, tol: float) -> list[str]:
    """What is wrong with a replica's measured logprob differences (`compare_served`); empty when it passes."""
    problems = []
    if values["max_diff_loaded"] >= tol:
        problems.append(f"the checkpoint as served differs from transformers by {values['max_diff_loaded']:.3g}")
    if values["max_diff_before"] <= tol:
        problems.append(f"the pushed weights moved logprobs by only {values['max_diff_before']:.3g}: cannot tell")
    if values["max_diff_after"] >= tol:
        problems.append(f"after the push the replica is {values['max_diff_after']:.3g} from the learner")
    if values["versions"] != [1]:
        problems.append(f"the replica reports version {values['versions']} after pushing version 1")
    return problems


def rollout(model: str) -> dict:
    """A replica as a run starts one; passes when, against the learner's reference of the same weights, its
    logprobs match at start and after the push, and differ before it (so the push is what made them match)."""
    from rlep.common.config import ServerConfig
    from rlep.services.launch.serve import start_rollout_worker
    from rlep.services.rollout.client import RolloutClient
    from rlep.services.rollout.config import EngineConfig, RolloutConfig

    original = checkpoint_tensors(Path(model))
    pushed = perturbed(original, seed=1)
    reference = Reference(model)
    # A short context: one short prompt is served, and the KV cache then fits whatever the model's own limit.
    engine = EngineConfig(model=model, max_model_len=512, max_num_seqs=8)
    started = time.perf_counter()
    running = start_rollout_worker(RolloutConfig(server=ServerConfig(host="127.0.0.1", port=0), engine=engine))
    start_s = time.perf_counter() - started
    client = RolloutClient([f"127.0.0.1:{running.port}"], timeout_s=300.0)
    try:
        prompt = running.engine.tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
        values = compare_served(client, reference, prompt, original, pushed)
    finally:
        client.close()
        running.stop()
    tol = ROLLOUT_TOLERANCE
    problems = served_problems(values, tol)
    detail = (
        f"max |logprob diff| after push {values['max_diff_after']:.2g} {'<' if not problems else 'vs'} {tol:g}"
        f" (before {values['max_diff_before']:.2g}, at start {values['max_diff_loaded']:.2g});"
        f" start {start_s:.0f} s, push {values['push_s']:.2f} s"
    )
    if problems:
        detail = "; ".join(problems) + f" ({detail})"
    return {"ok": not problems, "detail": detail, "values": {**values, "tolerance": tol, "start_s": start_s}}


# -- weight broadcast --------------------------------------------------------------------------
def _group(port: int, backend: str, timeout_s: float):
    from rlep.services.weights.broadcast import BroadcastGroup

    return BroadcastGroup("127.0.0.1", port, 2, backend, timeout_s)


def _device(backend: str) -> torch.device | None:
    return torch.device("cuda", 0) if backend == "nccl" else None  # the GPU CUDA_VISIBLE_DEVICES left visible


def broadcast_send(model: str, port: int, backend: str, timeout_s: float) -> dict:
    """Rank 0, the learner's end: joins the group and broadcasts the checkpoint's tensors."""
    from rlep.services.weights.broadcast import WeightSender

    tensors = checkpoint_tensors(Path(model))
    started = time.perf_counter()
    sender = WeightSender(_group(port, backend, timeout_s), _device(backend))
    join_s = time.perf_counter() - started
    started = time.perf_counter()
    sender.broadcast(tensors.values())
    send_s = time.perf_counter() - started
    sender.close()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    values = {
        "join_s": join_s,
        "send_s": send_s,
        "bytes": nbytes,
        "tensors": len(tensors),
        "digest": state_digest(list(tensors.values())),
    }
    return {"ok": True, "detail": f"sent {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB", "values": values}


def broadcast_receive(model: str, port: int, backend: str, timeout_s: float) -> dict:
    """Rank 1, as a rollout worker receives (`setup_communicator` + `receive_state_dict`); checks every tensor."""
    from rlep.services.weights.broadcast import manifest, receive_state_dict, setup_communicator

    expected = checkpoint_tensors(Path(model))
    communicator = setup_communicator(_group(port, backend, timeout_s), 1, _device(backend))
    received = receive_state_dict(communicator, manifest(expected))
    communicator.close()
    wrong = [name for name, tensor in received if not torch.equal(tensor.cpu(), expected[name])]
    values = {"tensors": len(received), "digest": state_digest([t for _, t in received])}
    detail = f"received {len(received)} tensors" + (
        f"; differ from the sent ones: {', '.join(wrong[:3])}" if wrong else ""
    )
    return {"ok": not wrong, "detail": detail, "values": values}


JOBS = {
    "learner": learner,
    "rollout": rollout,
    "broadcast-send": broadcast_send,
    "broadcast-receive": broadcast_receive,
}


def main(argv: list[str]) -> int:
    """`JOB KWARGS_JSON RESULT_PATH`: runs the job and writes its result; exit status 0 when it passed.

    A job that raises fails with the exception's message as its detail; its traceback goes to stderr after
    TRACEBACK_MARKER, for whoever reads the log (the doctor shows what was logged before it)."""
    from rlep.services.cli.doctor import TRACEBACK_MARKER

    job, kwargs, result_path = argv
    try:
        result = JOBS[job](**json.loads(kwargs))
    except Exception as err:  # the doctor reports it as the check's failure
        print(TRACEBACK_MARKER, file=sys.stderr, flush=True)
        traceback.print_exc()
        message = " ".join(str(err).split())
        result = {"ok": False, "detail": f"{type(err).__name__}: {message}", "values": {}}
    Path(result_path).write_text(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
