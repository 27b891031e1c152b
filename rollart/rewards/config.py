"""`run.reward_pool`: how many reward worker processes the reward gateway's `RewardPool` keeps and for how long.

Part of the topology (`rollart.topology`), so it imports nothing heavy: no torch, no worker processes.
"""

from __future__ import annotations

import msgspec


class RewardPoolSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The reward gateway's elastic pool of worker processes."""

    min_workers: int = 0
    """Workers kept even when idle (0: scale to zero)."""
    max_workers: int = 2
    """Most workers at once."""
    idle_timeout_s: float = 30.0
    """A worker idle this long retires (never below min_workers)."""
