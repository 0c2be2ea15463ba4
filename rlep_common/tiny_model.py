"""Small Qwen2 models and a character-level tokenizer, built locally (no model hub).

The tests, the benchmarks and `rlep demo` need a real HF-format checkpoint that vLLM, transformers
and DeepSpeed all load. `build_model(spec, dir)` writes one: `config.json`, `model.safetensors`,
`generation_config.json` and a `tokenizers` tokenizer that loads through `AutoTokenizer` (vLLM's
path) and round-trips text exactly. `cached_model(spec)` builds once per spec under
`~/.cache/rlep/models` and reuses it afterwards.

The tokenizer is character level on printable ASCII plus newline, with `\\boxed{` as one token:
arithmetic-style tasks then cost a token per character and answers are easy to find. It is a
byte-level BPE without merges, because transformers' `AutoTokenizer` (and so vLLM) loads any Qwen2
checkpoint's tokenizer as `Qwen2Tokenizer`, which reads the vocabulary as byte-level symbols
(space = "Ġ", newline = "Ċ"); a plain character vocabulary would be garbled there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from rlep.common.config import StrictModel

PAD, EOS = "<|pad|>", "<|endoftext|>"
EXTRA_TOKENS = ["\\boxed{"]
# "Q: <question>\nA: <answer>" — the chat template the demo task is trained on.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\n"
    "{% else %}A: {{ m['content'] }}" + EOS + "\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)


class ModelSpec(StrictModel):
    """Shape of a from-scratch Qwen2 causal LM (random init from `seed`)."""

    hidden_size: int = Field(128, ge=32)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(512, ge=1)
    vocab_size: int = Field(128, ge=128)
    """Padded embedding rows; must hold the tokenizer's vocabulary (~100 tokens)."""
    max_position_embeddings: int = Field(1024, ge=64)
    tie_word_embeddings: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0

    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]


PRESETS: dict[str, ModelSpec] = {
    # ~1M parameters: tests, the demo. vLLM's CPU attention wants head_dim >= 32.
    "tiny": ModelSpec(),
    # ~104M parameters: weight-push benchmarks at a realistic size.
    "100m": ModelSpec(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=3072, tie_word_embeddings=False
    ),
}


# GPT-2's byte-level spelling of the two non-printing characters we keep (printable ASCII maps to itself).
_BYTE_SYMBOL = {" ": "\u0120", "\n": "\u010a"}


def tokenizer_vocab() -> list[str]:
    """Token strings in id order: specials, printable ASCII and newline (byte-level spelling), extras."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    return [PAD, EOS, *(_BYTE_SYMBOL.get(c, c) for c in chars), *EXTRA_TOKENS]


def build_tokenizer(out_dir: Path):
    """Writes a character-level fast tokenizer into `out_dir` and returns it (a PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(tokenizer_vocab())}
    # Byte-level BPE without merges is exactly character level on this alphabet.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([PAD, EOS])
    core.add_tokens(EXTRA_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=PAD, model_max_length=PRESETS["tiny"].max_position_embeddings
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    # Pin the class: otherwise AutoTokenizer picks the architecture's own class (Qwen2Tokenizer),
    # which reinterprets the vocabulary as byte-level BPE and garbles text.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))
    return tokenizer


def build_model(spec: ModelSpec, out_dir: Path) -> Path:
    """Writes an HF checkpoint (weights, config, tokenizer) for `spec` into `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"vocab_size {spec.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id
    ).save_pretrained(out_dir)
    (out_dir / "rlep_model_spec.json").write_text(spec.model_dump_json(indent=2))
    return out_dir


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLEP_CACHE_DIR", Path.home() / ".cache" / "rlep")) / "models"


def cached_model(spec: ModelSpec | str = "tiny", cache_dir: Path | None = None) -> Path:
    """The checkpoint directory for `spec` (a preset name or a spec), built on first use.

    Built in a temporary directory and renamed into place, so concurrent callers (test workers,
    Ray actors) never see half a checkpoint.
    """
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown model preset {spec!r}; choose from {sorted(PRESETS)}")
        spec = PRESETS[spec]
    root = cache_dir or default_cache_dir()
    target = root / f"qwen2-{spec.hidden_size}h{spec.num_layers}l-{spec.fingerprint()}"
    if (target / "rlep_model_spec.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build_model(spec, scratch)
        try:
            scratch.rename(target)
        except OSError:  # another process finished first
            if not (target / "rlep_model_spec.json").exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def resolve_model(model: str) -> str:
    """A model path as services load it: a preset name (e.g. "tiny") becomes its cached build's directory."""
    return str(cached_model(model)) if model in PRESETS else model
