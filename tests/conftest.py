"""Fixtures shared by every test tier."""

from __future__ import annotations

import pytest

from tests.support import free_ports


@pytest.fixture
def free_port() -> int:
    """A loopback TCP port that was free a moment ago (bound to port 0, then released)."""
    return free_ports(1)[0]
