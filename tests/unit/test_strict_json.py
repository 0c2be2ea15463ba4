"""Request bodies as RFC 8259 JSON: what Python's parser takes but no reply can carry back is named."""

import pytest

from rlep.common.strict_json import MAX_JSON_DEPTH, json_depth, strict_json_problem, strict_loads


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b'{"a": NaN}', "NaN is not a JSON value"),
        (b'{"a": [-Infinity]}', "-Infinity is not a JSON value"),
        (b'{"a": 1e400}', "1e400 is out of range"),
        (b'{"a": -1e400}', "-1e400 is out of range"),
        (b'{"a": "x\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"\\udc00": 1}', "lone UTF-16 surrogate"),
        (b'{"a": ' + b"9" * 5000 + b"}", "digits"),
        (b"[" * 100_000 + b"]" * 100_000, "nest 100000 deep"),
        (b"[" * 5_000, "nest 5000 deep"),  # not even JSON: refused before the parser recurses
    ],
)
def test_what_python_parses_but_json_does_not_allow_is_named(body, named):
    assert named in strict_json_problem(body)


@pytest.mark.parametrize("body", [b'{"a": 1.5e300, "b": ["\\u00e9", "\\ud83d\\ude00"], "c": null}', b"[]", b'"x"'])
def test_strict_json_passes(body):
    assert strict_json_problem(body) is None


def test_a_body_that_is_not_json_is_left_to_the_frameworks_parser():
    assert strict_json_problem(b'{"model": ') is None


@pytest.mark.parametrize(
    ("text", "depth"),
    [("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ('["[[[", "\\"]"]', 1), ('["\\\\", [2]]', 2), ('"[[[', 0)],
)
def test_depth_counts_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth


def test_nesting_past_the_bound_is_a_value_error_before_parsing():
    """3,000 nested objects in a Verify item's `extra` raised RecursionError, which callers did not catch."""
    nested = '{"a": ' * 3_000 + "1" + "}" * 3_000
    with pytest.raises(ValueError, match="nest 3000 deep"):
        strict_loads(nested)
    at_bound = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert strict_loads(at_bound) == strict_loads(at_bound.encode())
    with pytest.raises(ValueError, match=f"nest {MAX_JSON_DEPTH + 1} deep"):
        strict_loads("[" + at_bound + "]")
