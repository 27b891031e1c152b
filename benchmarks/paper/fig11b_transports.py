"""Fig. 11b at scale: how long one version takes to reach every generator, by transport, for Qwen3-8B, Qwen3-32B
and Qwen3-30B-A3B at 8, 32 and 128 generators, next to the paper's and the anchors' figures.

The weights travel in bf16 (2 bytes a parameter) in 64 MiB buckets as a relay chain planned by cluster and host
(`rollart.sim.weight_sync.sync_times`, store and forward per bucket). The generators fill hosts of 8 GPUs: 8
engines of tensor parallel 8 (8 hosts), 32 of 2 (8 hosts), 128 of 1 (16 hosts). The transports, as links:

- **host TCP** (what RollArt runs today): every hop crosses host memory and one Python TCP stream, whose rate is
  capped at `TCP_GBPS` (2.0 GiB/s, what a raw TCP stream reached on the 2-core development machine,
  benchmarks/results/weight_sync.md), or the link where that is slower; the trainer in a cluster of its own;
- **NCCL** (inside one cluster: the trainer on hosts of the generation cluster): a pipelined broadcast, as a chain
  over the cluster's links, 400 Gb/s InfiniBand between hosts and NVLink (3,200 Gb/s) inside one;
- **UCX relay + NCCL** (across clusters, the paper's shape): the trainer's 200 Gb/s RDMA link to the chain's head
  in the generation cluster, then NCCL inside it as above.

Link rates are the paper's (`rollart.sim.weight_sync.Links`); nothing else is modelled (no per-bucket set-up,
no switch contention, no load into the engine). Only host TCP exists in RollArt today; the other two rows are what
issue 41's transports would reach if they ran at their links' speed.

    .venv/bin/python benchmarks/paper/fig11b_transports.py       # seconds; writes its section of fig11b.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fig11b_weight_sync import TITLE
from simrun import ROOT, write_section

from rollart.sim.hardware import MODELS
from rollart.sim.weight_sync import TRAINER, Links, Place, sync_times

HEADING = "Transports at scale: one version to every generator (analytic)"
TCP_GBPS = 2.0 * 8 * 1.073741824
"""2.0 GiB/s in Gb/s: one raw TCP stream on the 2-core development machine."""
SHAPES = {8: 8, 32: 2, 128: 1}
"""Generators -> GPUs per engine (tensor parallel)."""
NAMES = ["qwen3-8b", "qwen3-32b", "qwen3-30b-a3b"]
TRANSPORTS: dict[str, tuple[Links, Place]] = {
    "host TCP (today)": (Links(cross_gbps=min(200.0, TCP_GBPS), cluster_gbps=TCP_GBPS, host_gbps=TCP_GBPS), TRAINER),
    "NCCL (one cluster)": (Links(), Place("generation", "trainer")),
    "UCX relay + NCCL (two clusters)": (Links(), TRAINER),
}
ANCHORS = [
    "the paper: Mooncake between clusters and NCCL inside one; async push 1.10-1.16x step time (PAPER.md); "
    "no per-version transfer time given",
    "verl's checkpoint engine: Qwen3-30B-A3B to 30 GPUs in about 7 s over InfiniBand",
    "Kimi's checkpoint-engine: 1T parameters updated in about 20 s",
    "slime: Qwen3-30B-A3B sync cut from 120 s to 7 s with bucketed asynchronous gathers on GPU",
]
"""The anchors' figures as issue 41 quotes them (their own reports; not run here)."""


def places(generators: int) -> list[Place]:
    per_host = 8 // SHAPES[generators]
    return [Place("generation", f"host-{i // per_host}") for i in range(generators)]


def body() -> str:
    lines = [
        "| model | bf16 GB | generators | transport | last generator holds it, s | trainer egress / state |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name in NAMES:
        model = MODELS[name]
        state = model.params_b * 1e9 * 2
        for generators in SHAPES:
            for transport, (links, trainer) in TRANSPORTS.items():
                times = sync_times(state, places(generators), "relay", links=links, trainer=trainer)
                lines.append(
                    f"| {name} | {state / 1e9:.1f} | {generators} | {transport} | {times.last_s:.1f} "
                    f"| {times.egress_copies:.0f} |"
                )
    lines += [
        "",
        "The NCCL and UCX rows are bounds at the links' speed: the anchors' measured 7 s for Qwen3-30B-A3B is"
        " 3-6 times the bound for it here, what gathers, casts, set-up and the engines' loads add. Host TCP, the"
        " one built, is 20-25 times the NCCL bound: a Python stream's rate, not the links', decides it, and the"
        " relay keeps the trainer's egress at one copy whatever the number of generators.",
        "",
        "Anchors, from their own reports:",
        "",
        *(f"- {anchor}" for anchor in ANCHORS),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "paper" / "fig11b.md")
    args = parser.parse_args()
    began = time.monotonic()
    text = body()
    print(text)
    shape = (
        "analytic (`rollart.sim.weight_sync.sync_times`): bf16 weights in 64 MiB buckets, a relay chain by cluster "
        f"and host; host TCP capped at {TCP_GBPS:.1f} Gb/s a stream; 200 Gb/s between clusters, 400 Gb/s between "
        "hosts, 3,200 Gb/s inside one (the paper's links, NVLink's data sheet)"
    )
    write_section(args.out, TITLE, HEADING, began=began, shape=shape, body=text)


if __name__ == "__main__":
    main()
