"""A TCP port free on loopback right now (for servers told to pick one: tests, the embedded Redis, Ray's rendezvous)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on at this moment; another process may take it before the caller binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
