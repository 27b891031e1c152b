"""What `rollart check TOPOLOGY` says about the weight path: per version, the bytes, the route from the trainer to
every generator, the transport on each hop, the host memory a push needs, and an estimate of its time.

    weights: a version is 16.38 GB (bfloat16, the generators' dtype); tcp, relay, buckets of 64 MiB
      trainer -> gen-0  same host (127.0.0.1), 16 Gb/s (loopback TCP): ~8.2 s
      gen-0 -> gen-1    same host (127.0.0.1), 16 Gb/s (loopback TCP): pipelined behind the hop before
      push to all 2 generator(s): ~8.2 s per version; host memory for it: the trainer's host up to 49.1 GB ...

The estimate is the bytes over the slowest link of each hop: between two hosts the smaller `resources.network_gbps`
of the two nodes (or an assumed 10 Gb/s, said so), on one host loopback TCP at `LOOPBACK_GBPS`; a relay chain
forwards each bucket as it arrives, so a chain costs its slowest link plus a bucket per further hop, a star
costs the trainer's egress once per generator, and a group broadcast (`transport: nccl`) its slowest link once.
Links between GPUs (NVLink, InfiniBand) are what `resources.network_gbps` says: on one host the estimate still
uses loopback TCP's rate, which NCCL beats by far. It reads only the topology, so it runs anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart.generation.registry import backend as generation_backend
from rollart.models.shapes import ModelShape
from rollart.topology import NodeSpec, Topology
from rollart.topology.roles import Role
from rollart.topology.sizing import engine_dtype

LOOPBACK_GBPS = 16.0
"""Loopback TCP between two processes of one host, in Gb/s: about what a push of 1 GiB reached on the 2-core
development machine (benchmarks/results/weight_sync.md); a larger host does better."""
ASSUMED_NETWORK_GBPS = 10.0
"""A link between hosts whose nodes do not give `resources.network_gbps`."""
EXPORTS_KEPT = 3
"""Export buffers a trainer node with ranks keeps at most: the one being written, one being pushed, one spare."""
RECEIVES_KEPT = 2
"""Receive buffers a generator keeps: the version arriving while the engine applies the one before."""


@dataclass(frozen=True)
class Hop:
    source: NodeSpec
    target: NodeSpec
    gbps: float
    assumed: bool

    @property
    def where(self) -> str:
        if self.source.host == self.target.host:
            return f"same host ({self.target.host})"
        return f"{self.source.host} -> {self.target.host}"


def _link(a: NodeSpec, b: NodeSpec) -> tuple[float, bool]:
    if a.host == b.host:
        return LOOPBACK_GBPS, False
    given = [g for g in (a.resources.network_gbps, b.resources.network_gbps) if g is not None]
    return (min(given), False) if given else (ASSUMED_NETWORK_GBPS, True)


def _transport(topology: Topology) -> str:
    wanted = topology.run.trainer.weights.transport
    if topology.run.tls is not None:
        return "tcp (TLS)"
    if wanted == "nccl":
        return "nccl (an NCCL group where CUDA is, gloo otherwise)"
    return "ucx where ucxx is installed, else tcp" if wanted == "auto" else wanted


def weight_path_report(topology: Topology, shape: ModelShape | None) -> list[str]:
    """The lines `rollart check` prints about the weight path (none when no weights are pushed)."""
    trainers = [node for node in topology.nodes if node.role is Role.TRAINER and node.primary is None]
    generators = [node for node in topology.nodes if node.role is Role.GENERATOR]
    if not trainers or not generators or not generation_backend(topology.run.generator.backend).pushed_weights:
        return []
    if shape is None:
        return ["weights: not sized (no model shape)"]
    spec = topology.run.trainer.weights
    trainer = trainers[0]
    dtype = engine_dtype(topology, shape, on_gpu=any(g.resources.gpus > 0 for g in generators))
    nbytes = shape.weight_bytes(dtype)
    grouped = spec.transport == "nccl" and topology.run.tls is None
    fanout = "broadcast to every generator at once" if grouped else spec.fanout
    lines = [
        f"weights: a version is {nbytes / 1e9:.2f} GB ({dtype}, the generators' dtype); {_transport(topology)}, "
        f"{fanout}, buckets of {spec.bucket_mb:g} MiB" + (", deltas where smaller" if spec.delta else "")
    ]
    ordered = sorted(generators, key=lambda g: (g.cluster, g.host, g.name))
    if spec.fanout == "relay" and not grouped:
        hops = [Hop(a, b, *_link(a, b)) for a, b in zip([trainer, *ordered], ordered, strict=False)]
    else:
        hops = [Hop(trainer, g, *_link(trainer, g)) for g in ordered]
    width = max(len(f"{hop.source.name} -> {hop.target.name}") for hop in hops)
    for i, hop in enumerate(hops):
        seconds = nbytes * 8 / (hop.gbps * 1e9)
        rate = f"{hop.gbps:g} Gb/s" + (" assumed: set resources.network_gbps" if hop.assumed else "")
        if hop.source.host == hop.target.host and not grouped:
            rate += " (loopback TCP)"
        timing = "pipelined behind the hop before" if spec.fanout == "relay" and i else f"~{seconds:.1f} s"
        pair = f"{hop.source.name} -> {hop.target.name}".ljust(width)
        lines.append(f"  {pair}  {hop.where}, {rate}: {timing}")
    slowest = min(hop.gbps for hop in hops)
    bucket = min(spec.bucket_bytes, nbytes)
    if grouped:  # one broadcast: every link carries a bucket once, at the pace of the slowest
        total = nbytes * 8 / (slowest * 1e9)
    elif spec.fanout == "relay":
        total = nbytes * 8 / (slowest * 1e9) + (len(hops) - 1) * bucket * 8 / (slowest * 1e9)
    else:
        total = len(hops) * nbytes * 8 / (slowest * 1e9)
    exports = EXPORTS_KEPT * nbytes if topology.run.trainer.ranks > 1 or trainer.resources.gpus > 0 else nbytes
    receives = RECEIVES_KEPT * nbytes
    lines.append(
        f"  push to all {len(generators)} generator(s): ~{total:.1f} s per version; host memory for it: the trainer's "
        f"host up to {exports / 1e9:.1f} GB of export buffers, each generator's host {receives / 1e9:.1f} GB of "
        "receive buffers (an engine's workers map them: no further copy)"
    )
    return lines
