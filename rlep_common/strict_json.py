"""JSON as RFC 8259 defines it, for request bodies: Python's `json` also takes NaN, Infinity, numbers that overflow to
infinity and lone UTF-16 surrogates, none of which a reply can carry back (encoding them fails: a 500)."""

from __future__ import annotations

import json
import math
from typing import Any


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


def strict_loads(text: str | bytes) -> Any:
    """`json.loads` of strict JSON: NaN, Infinity and numbers that overflow to infinity raise ValueError, as any text
    that is not JSON does (a JSONDecodeError is a ValueError)."""
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
