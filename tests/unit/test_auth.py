"""The one Authorization rule (`rlep.common.auth.check_bearer`) that gRPC, /metrics and eval share."""

import pytest

from rlep.common.auth import DUPLICATE, MISSING, WRONG_SCHEME, WRONG_TOKEN, check_bearer, grpc_authorization_values


@pytest.mark.parametrize("value", ["Bearer tok", "bearer tok", "BEARER tok", "  Bearer   tok  ", b"Bearer tok"])
def test_the_scheme_is_case_insensitive(value):
    assert check_bearer([value], "tok") is None


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ([], MISSING),
        (["Bearer tok", "Bearer tok"], DUPLICATE),
        (["Bearer wrong", "Bearer tok"], DUPLICATE),
        (["Basic tok"], WRONG_SCHEME),
        (["tok"], WRONG_SCHEME),
        (["Bearer tok2"], WRONG_TOKEN),
        (["Bearer "], WRONG_TOKEN),
    ],
)
def test_refusals_name_their_reason(values, reason):
    assert check_bearer(values, "tok") == reason


def test_grpc_metadata_keeps_every_authorization_entry():
    metadata = [("x-other", "1"), ("authorization", "Bearer a"), ("authorization", "Bearer b")]
    assert grpc_authorization_values(metadata) == ["Bearer a", "Bearer b"]
    assert grpc_authorization_values(None) == []
