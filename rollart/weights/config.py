"""`run.trainer.weights`: how weights reach the generators, handed whole to the trainer's `WeightPublisher`.

Part of the topology, so it imports no torch: the launcher, the CLI and `rollart check` read it without the
weight path loaded. docs/weights.md says how to choose a transport and a fan-out.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Transport = Literal["auto", "tcp", "ucx", "nccl"]
Fanout = Literal["star", "relay"]


class WeightsSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How a version's weights go from the trainer to every generator."""

    transport: Transport = "auto"
    """ucx: UCX (`ucxx`) to each generator's UCX port; tcp: our TCP bulk path to its session port; nccl: each
    bucket broadcast once to every generator of a push over a process group of theirs (NCCL where CUDA is, gloo
    otherwise), the rest over TCP; auto: ucx where ucxx is installed, else tcp. With `run.tls`: tcp or auto (which
    is then tcp), since neither UCX nor NCCL encrypts."""
    bucket_mb: float = 64
    """Weight-push bucket size in MiB: a version travels, is checksummed and applied in buckets of about this
    size."""
    fanout: Fanout = "relay"
    """relay: the trainer sends a version once, to the head of a chain of generators ordered by cluster and
    host, and each forwards every bucket to the next as it arrives (the trainer's egress is one state dict);
    star: the trainer sends it to each. Ignored with transport nccl, whose pushes reach every generator at once
    by one broadcast."""
    delta: bool = False
    """Send a generator that holds the version before the latest only what changed (each bucket's bytes XOR
    the previous version's, byte-shuffled and zstd-compressed, where that is smaller): for links slower than
    ~0.5 GiB/s, where the bytes saved outweigh the encoding. Each generator then keeps the bytes of its last
    version (one more copy of the weights in its memory)."""
    push_timeout_s: float | None = None
    """Seconds a push may take before it counts as failed and is retried; None: scaled with its bytes (30 s
    plus four times the transfer at the slowest rate measured so far)."""

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * (1 << 20))

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.bucket_mb <= 0:
            problems.append(("bucket_mb", f"must be > 0, got {self.bucket_mb}"))
        if self.transport == "nccl" and self.delta:
            problems.append(("delta", "a group broadcast (transport: nccl) carries whole buckets; set delta: false"))
        if self.push_timeout_s is not None and self.push_timeout_s <= 0:
            problems.append(
                ("push_timeout_s", f"must be > 0 (or null: scaled with the bytes), got {self.push_timeout_s}")
            )
        return problems
