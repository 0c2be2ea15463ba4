"""Plain data of the replay service that its callers see: the error for a pool that does not exist.

Shared by the store (which raises it, and the server answers NOT_FOUND) and the client (which raises it
again when the server answered NOT_FOUND), so a caller catches one typed error and never a gRPC code.
"""

from __future__ import annotations


class PoolNotFound(KeyError):
    """No pool of this name exists; `args[0]` is the name."""
