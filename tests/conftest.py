"""Fixtures shared by every test tier."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def free_port() -> int:
    """A loopback TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
