"""Question identity shared by every service: the same prompt always gets the same id.

`question_id` hashes the chat prompt's content only: the sequence of (role, normalised content)
pairs, as canonical JSON. Normalisation is Unicode NFC, then every run of whitespace collapsed to
one space and the ends stripped, so re-encoded or re-wrapped copies of one prompt keep their id.

Left out on purpose:
- `data_source`: real datasets relabel it (DAPO-Math-17k says `DAPO-17k`, RLEP's released pool
  says `dapo_math` for the same prompts), and a question must find its replayed successes under
  either label.
- `extra_info.index`: DAPO-Math-17k repeats some prompts under different indices, and one question
  should share one pool of successes however often it appears.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Mapping

QUESTION_ID_HEX_CHARS = 24  # 96 bits: collisions are negligible for any dataset size we meet
_WHITESPACE = re.compile(r"\s+")


def normalise_content(text: str) -> str:
    """NFC, whitespace runs collapsed to one space, ends stripped."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFC", str(text))).strip()


def question_id(prompt: Iterable[Mapping[str, str]]) -> str:
    """Stable id of a question from its chat prompt (a list of {"role", "content"})."""
    messages = [[str(m["role"]).strip().lower(), normalise_content(m["content"])] for m in prompt]
    canonical = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:QUESTION_ID_HEX_CHARS]
