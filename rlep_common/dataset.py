"""Question identity shared by every service: the same prompt always gets the same id.

`question_id` hashes the data source and the chat prompt (roles and contents, canonical JSON).
`extra_info.index` is left out on purpose: DAPO-Math-17k repeats some prompts under different
indices, and one question should share one pool of successes however often it appears.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping

QUESTION_ID_HEX_CHARS = 24  # 96 bits: collisions are negligible for any dataset size we meet


def question_id(prompt: Iterable[Mapping[str, str]], data_source: str = "") -> str:
    """Stable id of a question from its chat prompt (a list of {"role", "content"})."""
    messages = [[str(m["role"]), str(m["content"])] for m in prompt]
    canonical = json.dumps([data_source, messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:QUESTION_ID_HEX_CHARS]
