"""Request bodies as RFC 8259 JSON: what Python's parser takes but no reply can carry back is named."""

import pytest

from rlep.common.strict_json import strict_json_problem


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
        (b"[" * 100_000 + b"]" * 100_000, "recursion"),
    ],
)
def test_what_python_parses_but_json_does_not_allow_is_named(body, named):
    assert named in strict_json_problem(body)


@pytest.mark.parametrize("body", [b'{"a": 1.5e300, "b": ["\\u00e9", "\\ud83d\\ude00"], "c": null}', b"[]", b'"x"'])
def test_strict_json_passes(body):
    assert strict_json_problem(body) is None


def test_a_body_that_is_not_json_is_left_to_the_frameworks_parser():
    assert strict_json_problem(b'{"model": ') is None
