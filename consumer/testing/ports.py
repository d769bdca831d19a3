"""Loopback ports for the servers the fixtures start (apart from any fixture, so the ones needing no extra
package import without the `testing` extra)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (for a server about to start)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
