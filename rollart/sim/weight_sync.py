"""Weight sync in simulation mode: when each generator holds a new version, and what the trainer sends.

A state dict of S bytes goes from the trainer to N generators (engine replicas) in buckets of b
bytes (the last one smaller), by one of two plans:

- **star**: the trainer sends every generator its own copy, all at once. Its egress link (the
  paper's cross-cluster Ethernet) is shared N ways: the last byte lands at N * S / W and the
  trainer sends N * S bytes.
- **relay**: the trainer sends each bucket once, to the first generator of the plan; a generator
  forwards each bucket to its children as soon as it holds it. Fan-out 1 is a chain; fan-out k a
  tree (the generator at plan position p has the children at k*p+1 .. k*p+k). The trainer sends S
  bytes whatever N is; a chain over links of one bandwidth W delivers the last byte at
  (S + (N - 1) * b) / W; a full tree of depth D (hops from the trainer) at about
  k * (S + (D - 1) * b) / W, since each inner hop carries 1/k of its sender's link.

Each hop stores and forwards whole buckets: bucket j has reached generator v when it had reached
v's sender, the hop had carried bucket j - 1, and its own transfer is done:

    done[v][j] = max(done[sender(v)][j], done[v][j - 1]) + size_j / rate(v)

with done[trainer][j] = 0 (the trainer holds every bucket at the start). A sender with k
children sends to all of them at once, so each hop gets 1/k of the link between the two ends: a
star is the trainer with N children. Which link depends on where the two ends are (`Links`):
across clusters (`cross_gbps`; the trainer's egress when it sits in a cluster of its own, as in
the paper), between hosts of one cluster (`cluster_gbps`), or inside a host (`host_gbps`).

The relay plan comes from the topology, as the real trainer plans it: generators in the trainer's
own cluster first, then cluster by cluster, host by host, so a chain crosses each cluster boundary
once and leaves each host once.

Not modelled: per-bucket overheads (set-up, checksums), latency, the load into the engine (the
caller adds it), and contention between hops that share a switch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from rollart.sim.hardware import EngineShape

Plan = Literal["star", "relay"]

GPUS_PER_HOST = 8
"""GPUs in one host (the paper's H800 and H20 machines): engine replicas fill hosts in order."""


@dataclass(frozen=True)
class Place:
    """Where a node sits: its cluster and its host."""

    cluster: str
    host: str


TRAINER = Place("training", "trainer")
"""The trainer, in a cluster of its own (the paper: training and inference clusters, Ethernet between)."""


@dataclass(frozen=True)
class Links:
    """Link bandwidths in gigabits per second, by where the two ends are."""

    cross_gbps: float = 200.0
    """Between clusters: the paper's 200 Gb/s Ethernet."""
    cluster_gbps: float = 400.0
    """Between hosts of one cluster: the paper's 400 Gb/s InfiniBand."""
    host_gbps: float = 3200.0
    """Inside a host: an H800's 400 GB/s NVLink (NVIDIA's data sheet; not the paper's number)."""

    def gbps(self, a: Place, b: Place) -> float:
        if a.cluster != b.cluster:
            return self.cross_gbps
        return self.cluster_gbps if a.host != b.host else self.host_gbps


@dataclass(frozen=True)
class SyncTimes:
    """One version's sync, timed from when the trainer starts sending it."""

    state_bytes: float
    arrival_s: tuple[float, ...]
    """Per generator (in the order given): when it holds the whole version."""
    senders: tuple[int, ...]
    """Per generator: the generator it receives from, -1 for the trainer."""
    trainer_egress_bytes: float
    trainer_busy_s: float
    """When the trainer's last byte has left: the next version can start on its link then."""

    @property
    def last_s(self) -> float:
        """When the last generator holds the version."""
        return max(self.arrival_s, default=0.0)

    @property
    def egress_copies(self) -> float:
        """Trainer egress over the state dict's size: N for a star, 1 for a relay."""
        return self.trainer_egress_bytes / self.state_bytes

    @property
    def depth(self) -> int:
        """Hops from the trainer to the farthest generator."""
        hops = [0] * len(self.senders)
        for v in _in_send_order(self.senders):
            hops[v] = 1 + (hops[self.senders[v]] if self.senders[v] >= 0 else 0)
        return max(hops, default=0)


def plan_order(places: Sequence[Place], trainer: Place = TRAINER) -> list[int]:
    """Generator indices in relay order: the trainer's cluster first, then by cluster and host."""
    return sorted(
        range(len(places)), key=lambda i: (places[i].cluster != trainer.cluster, places[i].cluster, places[i].host)
    )


def plan_senders(places: Sequence[Place], plan: Plan, *, fanout: int = 1, trainer: Place = TRAINER) -> list[int]:
    """Per generator, the index of the generator it receives from (-1: the trainer)."""
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout}")
    if plan == "star":
        return [-1] * len(places)
    order = plan_order(places, trainer)
    senders = [-1] * len(places)
    for position, v in enumerate(order[1:], start=1):
        senders[v] = order[(position - 1) // fanout]
    return senders


def sync_times(
    state_bytes: float,
    places: Sequence[Place],
    plan: Plan,
    *,
    fanout: int = 1,
    bucket_bytes: int = 64 << 20,
    links: Links = Links(),  # frozen: one shared default is safe
    trainer: Place = TRAINER,
) -> SyncTimes:
    """Time one version's sync of `state_bytes` to generators at `places` by `plan` (module docstring)."""
    if state_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError(f"state_bytes and bucket_bytes must be > 0, got {state_bytes}, {bucket_bytes}")
    full, rest = divmod(state_bytes, bucket_bytes)
    sizes = [float(bucket_bytes)] * int(full) + ([rest] if rest else [])
    senders = plan_senders(places, plan, fanout=fanout, trainer=trainer)
    children = [0] * len(places)
    trainer_children = 0
    for s in senders:
        if s >= 0:
            children[s] += 1
        else:
            trainer_children += 1
    done: list[list[float]] = [[] for _ in places]
    for v in _in_send_order(senders):
        sender = senders[v]
        share = children[sender] if sender >= 0 else trainer_children
        rate = links.gbps(places[sender] if sender >= 0 else trainer, places[v]) * 1e9 / 8 / share  # bytes/s
        upstream = done[sender] if sender >= 0 else [0.0] * len(sizes)
        times, t = [], 0.0
        for ready, size in zip(upstream, sizes, strict=True):
            t = max(ready, t) + size / rate
            times.append(t)
        done[v] = times
    arrival = tuple(times[-1] for times in done)
    direct = [v for v, s in enumerate(senders) if s < 0]
    return SyncTimes(
        state_bytes=state_bytes,
        arrival_s=arrival,
        senders=tuple(senders),
        trainer_egress_bytes=state_bytes * len(direct),
        trainer_busy_s=max((arrival[v] for v in direct), default=0.0),
    )


def _in_send_order(senders: Sequence[int]) -> list[int]:
    """Generators ordered so each comes after its sender."""
    order = [v for v, s in enumerate(senders) if s < 0]
    kids: dict[int, list[int]] = {}
    for v, s in enumerate(senders):
        if s >= 0:
            kids.setdefault(s, []).append(v)
    i = 0
    while i < len(order):  # breadth first: `order` grows by each one's children as it is reached
        order.extend(kids.get(order[i], []))
        i += 1
    return order


def engine_places(generators: Mapping[str, EngineShape], *, cluster: str = "generation") -> list[tuple[str, Place]]:
    """(generator node, place) for every engine replica of every node: a node's replicas fill hosts
    of `GPUS_PER_HOST` GPUs (a replica wider than a host is placed by its first host)."""
    places = []
    for name, shape in generators.items():
        per_host = max(1, GPUS_PER_HOST // shape.gpus)
        places += [(name, Place(cluster, f"{name}/{replica // per_host}")) for replica in range(shape.replicas)]
    return places
