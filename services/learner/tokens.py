"""The policy's tokenizer as the learner uses it: prompts it sends to rollout, and replayed answers it re-tokenises.

The learner renders every question itself (chat template with the generation prompt, then
`encode(add_special_tokens=False)`: exactly what the rollout server does for a chat prompt) and sends
token ids, so it can left-truncate long prompts, as the reference recipe does (`truncation: left`),
instead of letting one over-long prompt fail the rollout call.

A replayed answer is trained as if the policy had sampled it for this step's prompt: the question's
prompt ids of this step, then the answer's response ids. Those are the stored ids when the pool's
tokenizer fingerprint equals the policy's, else `encode(text) + EOS`, cut to the response limit, which
is how RLEP's reference builds replayed rows from the released pool's candidate texts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EncodedPrompt:
    token_ids: tuple[int, ...]
    truncated_tokens: int = 0
    """Tokens cut from the left (0 = the whole prompt)."""


@dataclass(frozen=True)
class EncodedResponse:
    token_ids: tuple[int, ...]
    truncated: bool = False
    """True when the answer (with its EOS) was longer than the response limit and was cut."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What makes token ids comparable: vocabulary, merges, normalisation and special tokens (not the template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = backend.to_str()
    else:  # a slow tokenizer: its vocabulary is what maps text to ids
        spec = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    digest = hashlib.sha256(spec.encode("utf-8"))
    digest.update(f"|eos={tokenizer.eos_token_id}|pad={tokenizer.pad_token_id}".encode())
    return digest.hexdigest()[:32]


class PolicyTokenizer:
    def __init__(self, tokenizer: Any, max_prompt_tokens: int, max_response_tokens: int):
        if tokenizer.eos_token_id is None:
            raise ValueError("the policy's tokenizer has no EOS token: replayed answers could not be terminated")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the policy's tokenizer has no chat template (tokenizer.chat_template is not set)")
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_response_tokens = max_response_tokens
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else self.eos_id
        self.fingerprint = tokenizer_fingerprint(tokenizer)

    @classmethod
    def load(cls, model_dir: Path | str, max_prompt_tokens: int, max_response_tokens: int) -> PolicyTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir), max_prompt_tokens, max_response_tokens)

    def fit_model_length(self, max_model_len: int) -> None:
        """Lowers the prompt limit so prompt + max_response_tokens always fits the rollout model."""
        budget = max_model_len - self.max_response_tokens
        if budget < 1:
            raise ValueError(
                f"max_response_tokens {self.max_response_tokens} leaves no room for a prompt in the rollout "
                f"model's length {max_model_len}"
            )
        self.max_prompt_tokens = min(self.max_prompt_tokens, budget)

    def encode_prompt(self, messages: Sequence[Mapping[str, str]]) -> EncodedPrompt:
        """Chat-templated prompt ids (generation prompt added), left-truncated to `max_prompt_tokens`."""
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        cut = max(0, len(ids) - self.max_prompt_tokens)
        return EncodedPrompt(tuple(ids[cut:]), cut)

    def encode_response(self, text: str) -> EncodedResponse:
        """`text` + EOS as response ids, cut to `max_response_tokens`."""
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos_id]
        return EncodedResponse(tuple(ids[: self.max_response_tokens]), len(ids) > self.max_response_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
