"""The learner on CUDA (skipped where there is none): the update equals the CPU update on the same tiny fp32
model under ZeRO-0/2/3, bf16 with gradient checkpointing trains, checkpoints written on CUDA resume on CUDA and load
on the CPU, and the chunked logprobs stay within their memory bound at a real vocabulary.

Each learner run is `update_probe.py` in a process of its own (DeepSpeed keeps one process group per process);
the CPU reference runs the same script with CUDA hidden. Run on a GPU node: `pytest tests/gpu -m gpu`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run tests/gpu on a GPU node)"),
]

PROBE = Path(__file__).with_name("update_probe.py")


def probe(model_dir: Path, out: Path, *flags: str, cpu: bool = False) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if cpu else dict(os.environ)
    env.pop("DS_ACCELERATOR", None)
    done = subprocess.run(
        [sys.executable, str(PROBE), str(model_dir), str(out), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def relative_change_gap(a: dict, b: dict) -> float:
    """|delta_a - delta_b| / |delta_b| over all weights: how far two updates from the same start disagree."""
    da = {k: a["final"][k] - a["initial"][k] for k in a["final"]}
    db = {k: b["final"][k] - b["initial"][k] for k in b["final"]}
    gap = sum(float((da[k] - db[k]).pow(2).sum()) for k in da) ** 0.5
    return gap / sum(float(v.pow(2).sum()) for v in db.values()) ** 0.5


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rlep.common.tiny_model import cached_model

    return cached_model("tiny")


@pytest.fixture(scope="module")
def cpu_reference(model_dir, tmp_path_factory) -> dict:
    return probe(model_dir, tmp_path_factory.mktemp("cpu") / "out.pt", "--stage", "0", cpu=True)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_cuda_update_equals_the_cpu_update(model_dir, cpu_reference, tmp_path, stage):
    cuda = probe(model_dir, tmp_path / "out.pt", "--stage", str(stage))
    assert cuda["device"].startswith("cuda") and cpu_reference["device"] == "cpu"
    mask = cpu_reference["loss_mask"].bool()
    # fp32 without TF32; kernels sum in other orders, so logprobs agree to ~1e-5 and the Adam steps to well under 1%.
    torch.testing.assert_close(cuda["old_logprobs"][mask], cpu_reference["old_logprobs"][mask], atol=1e-4, rtol=0)
    assert relative_change_gap(cuda, cpu_reference) < 1e-2
    for key in ("loss", "entropy", "clip_fraction", "approx_kl"):
        assert cuda["stats"][key] == pytest.approx(cpu_reference["stats"][key], rel=1e-3, abs=1e-5), key


def test_bf16_with_gradient_checkpointing_trains_on_cuda(model_dir, tmp_path):
    out = probe(model_dir, tmp_path / "out.pt", "--stage", "2", "--bf16", "--checkpointing")
    assert all(torch.isfinite(torch.tensor(v)) for v in out["stats"].values())
    assert any(not torch.equal(out["final"][k], out["initial"][k]) for k in out["final"])
    assert out["adam"] in ("deepspeed_fused", "torch_fused")  # never the slow per-tensor loop on a GPU


def test_a_cuda_checkpoint_resumes_on_cuda_and_loads_on_the_cpu(model_dir, tmp_path):
    first = probe(model_dir, tmp_path / "first.pt", "--stage", "2", "--save-checkpoint", str(tmp_path / "ckpt"))
    on_cuda = probe(model_dir, tmp_path / "cuda.pt", "--stage", "2", "--load-checkpoint", str(tmp_path / "ckpt"))
    on_cpu = probe(
        model_dir, tmp_path / "cpu.pt", "--stage", "2", "--load-checkpoint", str(tmp_path / "ckpt"), cpu=True
    )
    for resumed in (on_cuda, on_cpu):
        torch.testing.assert_close(resumed["initial"], first["final"], atol=1e-6, rtol=0)
        assert torch.equal(resumed["rng_after_load"]["cpu"], first["rng_at_save"]["cpu"])
    assert torch.equal(on_cuda["rng_after_load"]["cuda"], first["rng_at_save"]["cuda"])
    # Adam's moments came back too: the second update is the same step on both devices.
    assert relative_change_gap(on_cuda, on_cpu) < 1e-2


def test_chunked_logprobs_stay_within_their_memory_bound_at_a_real_vocabulary():
    from rlep.services.learner.batch import SCORE_CHUNK_POSITIONS, token_scores

    rows, length, hidden_size, vocab = 8, 4096, 896, 151_936
    device = torch.device("cuda")
    head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(rows, length, hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, length), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logprobs, entropy = token_scores(hidden, head, tokens)
    logprobs.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full_float32 = rows * length * vocab * 4  # one [N, L, V] float32 copy: ~20 GB
    chunk = SCORE_CHUNK_POSITIONS * vocab * 4
    # A few [chunk, V] float32 blocks and the gradients of `hidden` and the head, never an [N, L, V] copy.
    assert peak < 6 * chunk + 2 * hidden.numel() * 2 + 2 * head.weight.numel() * 4, peak
    assert peak < full_float32 / 5
    assert torch.isfinite(logprobs).all() and torch.isfinite(entropy).all()
