"""The one rule deciding an `Authorization` header, shared by every transport (gRPC, /metrics, eval's REST).

A request is let in when it carries exactly one `Authorization` header whose scheme is `Bearer`
(any letter case, RFC 7235 §2.1) followed by the expected token; the token is compared in constant
time. Two headers are refused rather than picking one: proxies and frameworks disagree on which one
wins, so accepting either would let a request mean different things to different hops.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

SCHEME = "bearer"
MISSING = "missing bearer token: send `Authorization: Bearer <token>`"
DUPLICATE = "more than one Authorization header: send exactly one"
WRONG_SCHEME = "Authorization scheme must be Bearer"
WRONG_TOKEN = "wrong bearer token"


def check_bearer(header_values: Iterable[str | bytes], token: str) -> str | None:
    """Decides whether a request's `Authorization` headers present `token`.

    Args:
        header_values: every `Authorization` header value of the request, in order (none when absent).
        token: the expected token (non-empty).

    Returns:
        None when the request is let in, else why not: a short message that is safe to send back
        (it never echoes what was presented).
    """
    values = [v.decode("latin-1") if isinstance(v, bytes) else v for v in header_values]
    if not values:
        return MISSING
    if len(values) > 1:
        return DUPLICATE
    scheme, _, credentials = values[0].strip().partition(" ")
    if scheme.lower() != SCHEME:
        return WRONG_SCHEME
    # compare_digest on bytes takes the same time wherever the first difference is.
    if not hmac.compare_digest(credentials.strip().encode(), token.encode()):
        return WRONG_TOKEN
    return None


def grpc_authorization_values(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[str | bytes]:
    """The `authorization` entries of gRPC invocation metadata (keys arrive lower-cased), every one kept."""
    return [value for key, value in metadata or () if key.lower() == "authorization"]
