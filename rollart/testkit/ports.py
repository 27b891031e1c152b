"""Free loopback ports, for nodes, proxies and test servers started on this machine."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """N distinct ports that were free a moment ago (bound to port 0 together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
