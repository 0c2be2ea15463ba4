"""JSON as RFC 8259 defines it, for request bodies: Python's `json` also takes NaN, Infinity, numbers that overflow to
infinity and lone UTF-16 surrogates, none of which a reply can carry back (encoding them fails: a 500).

Nesting is bounded before parsing (`MAX_JSON_DEPTH`): Python's parser and every recursive walk after it (encoding,
pickling, a scorer's own code) raise RecursionError near 1,000 levels, which callers that expect ValueError for a
bad body do not catch.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 100
"""Arrays and objects nested deeper than this are refused; no body we take nests past a handful of levels."""

# A string literal, escapes included; an unterminated one runs to the end, so every match ends where the next search
# starts (linear time whatever the text).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]++")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(text: str | bytes) -> int:
    """How deeply arrays and objects nest in `text` (0 for a scalar), counting brackets outside string literals."""
    data = _as_bytes(text)
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _strings_encodable(value: Any) -> None:
    if isinstance(value, str):
        value.encode("utf-8")  # UnicodeEncodeError for a lone surrogate ("\ud800")
    elif isinstance(value, dict):
        for key, item in value.items():
            _strings_encodable(key)
            _strings_encodable(item)
    elif isinstance(value, list):
        for item in value:
            _strings_encodable(item)


def strict_loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` of strict JSON: NaN, Infinity, numbers that overflow to infinity and nesting deeper than
    `max_depth` raise ValueError, as any text that is not JSON does (a JSONDecodeError is a ValueError)."""
    data = _as_bytes(text)
    # Depth cannot pass the number of opening brackets: counting them (C speed) spares most bodies the scan.
    if data.count(b"[") + data.count(b"{") > max_depth and (depth := json_depth(data)) > max_depth:
        raise ValueError(f"arrays and objects nest {depth} deep; at most {max_depth} are taken")
    return json.loads(text, parse_constant=_constant, parse_float=_finite)


def strict_json_problem(body: bytes) -> str | None:
    """Why `body` is not strict JSON (NaN, Infinity, an overflowing or over-long number, a lone surrogate), or None.
    A body that is not JSON at all is not judged here (None): the framework's own parser reports it."""
    try:
        value = strict_loads(body)
    except json.JSONDecodeError:
        return None
    except (ValueError, RecursionError) as err:  # ours, int digits past Python's limit, nesting too deep
        return f"the body is not strict JSON: {err}"
    try:
        _strings_encodable(value)
    except UnicodeEncodeError:
        return "the body is not strict JSON: a string holds a lone UTF-16 surrogate"
    except RecursionError:
        return "the body is not strict JSON: nested too deeply"
    return None
