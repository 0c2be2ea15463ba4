"""Pulling the final answer out of a response (pure string logic, shared by the verifier and the demo's task).

RLEP/DAPO conventions: the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces; failing that, the
last "Answer: X" line (DAPO-Math's prompt format). An unbalanced last `\\boxed{` is no boxed answer at all.
"""

from __future__ import annotations

import re

BOXED_MARKERS = ("\\boxed", "\\fbox")
# DAPO-Math asks for a last line "Answer: $Answer"; verl's math_dapo reads it the same way.
# Markdown emphasis around it ("**Answer:** 9") is common in chat models' output and tolerated.
ANSWER_LINE = re.compile(r"(?im)^[ \t*#]*answer[ \t*]*:[ \t*]*(\S[^\n]*)$")


def _balanced_group(text: str, open_index: int) -> str | None:
    """Content of the `{...}` group opening at `open_index`, or None when it never closes."""
    depth = 0
    for i in range(open_index, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}`; also `\\boxed 5`. None if absent."""
    start = max(text.rfind(marker) for marker in BOXED_MARKERS)
    if start < 0:
        return None
    marker = next(m for m in BOXED_MARKERS if text.startswith(m, start))
    rest = start + len(marker)
    if text.startswith("{", rest):
        return _balanced_group(text, rest)
    if text.startswith(" ", rest):  # `\boxed 5`: the token after the space
        token = text[rest + 1 :].split(maxsplit=1)
        return token[0].rstrip("$.") if token else None
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: last boxed group, else last "Answer:" line. None if neither."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed.strip()
    matches = ANSWER_LINE.findall(response)
    if not matches:
        return None
    answer = matches[-1].strip().rstrip("*").strip()
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    return answer or None
