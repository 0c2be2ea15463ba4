"""How a learner process joins DeepSpeed: its device, the process group, the engine config, the Adam it uses,
and the model loaded (partitioned from the start under ZeRO-3).

Device: a process drives one accelerator. Under Ray an actor given one GPU sees just that GPU (Ray sets
CUDA_VISIBLE_DEVICES), so its device is index 0 whatever its global rank; a launcher such as torchrun says
which one with LOCAL_RANK. `local_device_index` decides, and `init_distributed` sets that device before the
process group starts (NCCL binds a communicator to the current device).

Adam: on CUDA, DeepSpeed's FusedAdam; under optimizer offload, DeepSpeed's CPU Adam; each only where its op loads
(prebuilt, or JIT-built here: `load_deepspeed_op` tries it where the choice is made), else PyTorch's fused AdamW,
which needs no build, with a warning naming why. Whether a build would work cannot be told without trying it:
DeepSpeed's `is_compatible` is true for these ops wherever they exist, ninja comes with DeepSpeed, and a CUDA
toolkit of another major version than torch's compiles into an op that fails. On a CPU machine without offload the
learner keeps PyTorch's plain AdamW (DeepSpeed's fused CPU Adam is a ~6 min JIT build for a tiny model).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from rlep.services.learner.config import DeepSpeedConfig, OptimConfig
from rlep.services.learner.jit_locks import clear_stale_jit_locks

log = logging.getLogger(__name__)

TRAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

AdamKind = Literal["deepspeed_fused", "deepspeed_cpu", "torch_fused", "torch"]
# DeepSpeed op builder (class name) behind each of its Adams.
ADAM_OPS = {"deepspeed_fused": "FusedAdamBuilder", "deepspeed_cpu": "CPUAdamBuilder"}


def local_device_index(rank: int, visible_devices: int, launcher_local_rank: str | None) -> int:
    """The index, among this process's visible accelerators, of the one it drives.

    Args:
        rank: global rank.
        visible_devices: accelerators this process sees (0 on a CPU machine).
        launcher_local_rank: LOCAL_RANK as a launcher (torchrun, deepspeed) set it, or None (Ray actors).
    """
    if visible_devices == 0:
        return 0
    if launcher_local_rank is not None:
        index = int(launcher_local_rank)
    else:
        # Ray gives each actor its own GPU, so it sees one; seeing several, processes share a node's GPUs.
        index = 0 if visible_devices == 1 else rank % visible_devices
    if not 0 <= index < visible_devices:
        raise RuntimeError(f"local rank {index} but this process sees {visible_devices} accelerator(s)")
    return index


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Joins the learner's process group: NCCL between GPUs, gloo on CPUs, on this process's own device."""
    import deepspeed

    clear_stale_jit_locks()  # DeepSpeed loads its JIT-built ops below; a dead builder's lock would hang it
    on_cuda = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_cuda else "cpu")
    local = local_device_index(rank, torch.cuda.device_count() if on_cuda else 0, os.environ.get("LOCAL_RANK"))
    if on_cuda:
        torch.cuda.set_device(local)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),  # DeepSpeed's engine takes its device from it
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
    )
    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo", auto_mpi_discovery=False)


def choose_adam(
    preference: Literal["auto", "torch", "deepspeed"], on_cuda: bool, offload: bool, load_op: Callable[[str], None]
) -> AdamKind:
    """Which Adam the engine gets (module docstring). `load_op(builder)` loads a DeepSpeed op (`load_deepspeed_op`),
    building it if need be, and raises, saying why, when it cannot: `auto` then falls back to PyTorch's fused AdamW
    with a warning, `deepspeed` fails naming the cause."""
    if not on_cuda and not offload:
        if preference == "deepspeed":
            raise ValueError("deepspeed.adam=deepspeed needs CUDA or optimizer offload; on CPUs use auto or torch")
        return "torch"
    wanted: AdamKind = "deepspeed_cpu" if offload else "deepspeed_fused"
    if preference == "torch":
        return "torch_fused"
    op = ADAM_OPS[wanted]
    try:
        load_op(op)
    except Exception as error:  # a JIT build fails in many ways (compiler, toolkit, link, import): each means "no"
        if preference == "deepspeed":
            raise RuntimeError(
                f"deepspeed.adam=deepspeed: DeepSpeed's {op} op could not be loaded: {error!r}. Install DeepSpeed with "
                "DS_BUILD_OPS=1, or a CUDA toolkit of torch's version with a compiler; deepspeed.adam=auto falls back "
                "to PyTorch's fused AdamW"
            ) from error
        log.warning("DeepSpeed's %s op could not be loaded (%r): using PyTorch's fused AdamW instead", op, error)
        return "torch_fused"
    return wanted


def load_deepspeed_op(builder_name: str) -> None:
    """Loads DeepSpeed's op `builder_name` (e.g. FusedAdamBuilder): the prebuilt one, else JIT-built here (minutes,
    once: later loads come from torch's extension cache, and the engine's own load from DeepSpeed's). Raises when it
    cannot, naming why; a JIT build of a CUDA op first needs the toolkit's CUDA to be torch's."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, assert_no_cuda_mismatch

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None:
        raise RuntimeError(f"DeepSpeed has no {builder_name} for the {get_accelerator().device_name()} accelerator")
    if isinstance(builder, CUDAOpBuilder) and not installed_ops.get(builder.name, False):
        assert_no_cuda_mismatch(builder.name)  # raises naming both versions, or that there is no toolkit
    builder.load()


def deepspeed_config(
    optim: OptimConfig, ds: DeepSpeedConfig, world_size: int, adam: AdamKind = "torch"
) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # really partition small models too
    if ds.offload_optimizer and ds.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    adam_params: dict[str, Any] = {"lr": optim.lr, "betas": list(optim.betas), "weight_decay": optim.weight_decay}
    if adam.startswith("torch"):
        adam_params["torch_adam"] = True  # DeepSpeed passes the other params on to torch.optim.AdamW
        if adam == "torch_fused":
            adam_params["fused"] = True
    return {
        # Boundaries are set by hand per mini-batch; DeepSpeed's own count only has to be consistent.
        "train_micro_batch_size_per_gpu": optim.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": optim.micro_batch_size * world_size,
        "gradient_clipping": optim.grad_clip,
        "optimizer": {"type": "AdamW", "params": adam_params},
        "bf16": {"enabled": ds.dtype == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # No DeepSpeed scheduler: it counts optimizer steps, and warm-up counts training steps.
    }


@contextlib.contextmanager
def partitioned_loading(ds_config: dict[str, Any]) -> Iterator[None]:
    """Under ZeRO-3, `from_pretrained` inside this block builds the model partitioned (deepspeed.zero.Init via
    transformers' DeepSpeed integration): no process ever holds the whole model. Elsewhere it does nothing."""
    if ds_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(ds_config)  # transformers reads it through a weak reference: keep it alive
    try:
        yield
    finally:
        del hf_config
        unset_hf_deepspeed_config()  # later loads in this process (a stage-2 run) must not see it


def load_model(model_dir: Path, ds: DeepSpeedConfig, ds_config: dict[str, Any]) -> torch.nn.Module:
    """The HF causal LM in the training dtype (partitioned under ZeRO-3), with gradient checkpointing if asked."""
    from transformers import AutoModelForCausalLM

    with partitioned_loading(ds_config):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TRAIN_DTYPES[ds.dtype])
    if ds.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
