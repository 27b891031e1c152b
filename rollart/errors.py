"""The exception hierarchy's root: every error RollArt raises on purpose is a `RollartError`.

A leaf module: it imports nothing, and every layer may import it (envs, rewards and engines raise a
`ConfigError` without knowing the wire exists). The wire's own errors (a bad frame, a lost session, a
remote handler's failure) are in `rollart.protocol.errors`, subclasses of `RollartError`.
"""

from __future__ import annotations


class RollartError(Exception):
    """Base of every error RollArt raises on purpose."""


class ConfigError(RollartError):
    """A configuration or topology file is invalid; the message names the path and the problem."""


class DeadlineExceeded(RollartError, TimeoutError):
    """Work given a deadline (a reward call, an env call, a request) did not finish by it."""
