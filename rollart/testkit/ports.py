"""Free loopback ports, for nodes, proxies and test servers started on this machine.

They are drawn from below the kernel's ephemeral range (`ip_local_port_range`), never from it: a
port the kernel hands out for `bind(0)` or an outgoing connection may be handed out again before
the node that was given it binds, or between its death and its restart on the same port. A Slurm
job's `srun` once took a trainer's port that way; the trainer could not bind it five times over,
and every peer's reconnect reached `srun` instead.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000
"""Below this are the well-known and registered services a test machine may run."""


def _ephemeral_start() -> int | None:
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # not Linux: the kernel's own choice (bind 0) is all there is


def free_ports(n: int) -> list[int]:
    """N distinct ports that were free a moment ago, from below the ephemeral range (module docstring)."""
    start = _ephemeral_start()
    if start is None or start - LOWEST < 4 * n:
        return _kernel_ports(n)
    chosen: list[int] = []
    # not the module's generator: a test that seeds it would draw the same ports as the test before
    candidates = random.SystemRandom().sample(range(LOWEST, start), min(start - LOWEST, 50 * n))
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or in TIME_WAIT): the next one
        chosen.append(port)
        if len(chosen) == n:
            return chosen
    raise RuntimeError(f"no {n} free loopback ports between {LOWEST} and {start}")


def _kernel_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
