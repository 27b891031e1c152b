"""What the publisher knows of each generator it pushes to, and the rules that change it.

`TargetStats` is the part shown in the trainer's `/status` (under `weights`); `Target` adds what
planning needs: the version not to push again, the delta base the generator keeps, its backoff,
its connection. The publisher (`rollart.weights.publisher`) owns them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import structlog
import torch

from rollart.protocol.config import SessionConfig
from rollart.protocol.framing import Connection
from rollart.weights.snapshot import Snapshot
from rollart.weights.wire import Holding, Hop, VersionAck

log = structlog.get_logger("rollart.weights.publisher")


@dataclasses.dataclass
class TargetStats:
    name: str
    transport: str
    dtype: str = ""
    """The dtype floating-point weights travel to it in; empty: as the trainer holds them."""
    version: int = -1
    """The version the target holds, as it last said (-1: not heard from yet)."""
    pushes: int = 0
    """Versions it acknowledged, from the trainer or through a relay."""
    relayed: int = 0
    """Of those, how many came through another generator."""
    last_push_s: float = 0.0
    """First byte the trainer sent for the version to this target's acknowledgement (includes `apply`)."""
    last_push_bytes: int = 0
    bytes_sent: int = 0
    """Bytes the trainer sent to it (none when it gets its versions through a relay)."""
    failures: int = 0
    deltas: int = 0
    """Of the versions it acknowledged, how many came as deltas."""
    skipped: int = 0
    """Published versions this target never got because a newer one was ready first."""
    in_flight: int | None = None
    """The version being pushed to it (directly or through a relay)."""
    via: str = ""
    """Who the version in flight comes from: 'trainer' or the generator relaying it."""
    progress_bytes: int = 0
    """Of the push in flight from the trainer, the bytes sent so far (of `progress_of`)."""
    progress_of: int = 0
    connected: bool = False
    last_error: str = ""


@dataclasses.dataclass(eq=False)
class Target:
    host: str
    port: int
    ucx_port: int | None
    dtype: torch.dtype | None
    place: str
    stats: TargetStats
    settled: int = -1
    """Newest version not to push again: the one it holds, or one it refused."""
    base: int = -1
    """The version whose bytes it keeps for deltas, as it last said (-1: none)."""
    last_seq: int = 0
    busy: bool = False
    attempt: int = 0
    retry_at: float = 0.0
    conn: Connection | None = None
    watch: asyncio.Task[None] | None = None

    def hop(self) -> Hop:
        return Hop(self.stats.name, self.host, self.port, self.ucx_port or 0)

    def connected(self, holding: Holding) -> None:
        """A new connection's first word: what it holds, and which version's bytes it keeps."""
        self.stats.connected, self.stats.version, self.settled = True, holding.version, holding.version
        self.base = holding.base
        log.info("weights.connected", target=self.stats.name, holds=holding.version, via=self.stats.transport)

    def acked(self, ack: VersionAck, snap: Snapshot, seconds: float, *, relayed: bool, delta: bool) -> None:
        s = self.stats
        s.version, self.settled, self.base = ack.holding, max(ack.holding, snap.version), ack.base
        if ack.error:
            s.failures += 1
            s.last_error = f"version {snap.version} refused: {ack.error}"
            log.error("weights.refused", target=s.name, version=snap.version, error=ack.error)
            return
        s.pushes, s.relayed, s.deltas = s.pushes + 1, s.relayed + relayed, s.deltas + delta
        s.last_push_s, s.last_push_bytes = seconds, snap.nbytes
        s.skipped += max(0, snap.seq - self.last_seq - 1)
        self.last_seq, self.attempt = snap.seq, 0
        log.info("weights.pushed", target=s.name, version=snap.version, seconds=round(seconds, 4), relayed=relayed)

    def failed(self, exc: BaseException, cfg: SessionConfig) -> None:
        """Count the failure and back off (jittered, exponential)."""
        self.base = -1  # perhaps it lost (or never had) the base of a delta: whole versions until it says
        self.stats.failures += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        delay = random.uniform(0, min(cfg.backoff_cap_s, cfg.backoff_base_s * 2**self.attempt))
        self.attempt += 1
        self.retry_at = time.monotonic() + delay
        log.warning("weights.push_failed", target=self.stats.name, error=self.stats.last_error, attempt=self.attempt)

    def behind(self, version: int) -> None:
        """It holds an older version than it acknowledged (restarted): it gets the latest again, whole."""
        log.info("weights.target_behind", target=self.stats.name, holds=version, had=self.settled)
        self.settled = self.stats.version = version
        self.base = -1
