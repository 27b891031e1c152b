"""Which CPU cores each node of a one-machine run works on.

The local launcher gives every trainer and generator node its share of the machine's cores, so
that the nodes stop oversubscribing them: on 2 cores, two vLLM engines and a trainer each sized for
the whole machine made a training step take 4-10x its time alone, its threads waiting on each
other while the engines held the cores. A node's share reaches it as `ROLLART_CPUS` (a core list,
`0-3,6`) and `OMP_NUM_THREADS` in its environment; the node pins itself and its children to those
cores (`rollart.cpus.pin_from_env`), torch sizes its intra-op threads to them (an fsdp2 trainer's
ranks divide them), and a vLLM engine binds its threads to them (`VLLM_CPU_OMP_THREADS_BIND`).

The shares: a node's `resources.cpus` where the topology gives them (0.5 is half a core: two such
nodes share one), laid out core after core in the topology's order, wrapping around when the
machine has fewer cores than asked (the launcher says so). When no node gives any, a split picked
for the machine: half the cores for the trainer nodes, half for the generators, each half divided
evenly among its nodes (all of them for the generators in a rollout-only run). Env-hosts, reward
gateways and nodes without a share float over all cores (they wait on sockets more than they
compute). On one core nothing is pinned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from rollart.cpus import ENV, cpu_list
from rollart.topology import NodeSpec, Topology
from rollart.topology.roles import Role


@dataclasses.dataclass(frozen=True)
class CpuSplit:
    """Each pinned node's cores; `picked`: chosen for this machine (no node gave `resources.cpus`)."""

    cores: dict[str, tuple[int, ...]]
    available: tuple[int, ...]
    picked: bool
    oversubscribed: bool

    def env_for(self, node: str) -> dict[str, str]:
        """What to add to a node's environment: its cores and thread count, or nothing (it floats)."""
        cores = self.cores.get(node)
        if not cores:
            return {}
        return {ENV: cpu_list(cores), "OMP_NUM_THREADS": str(len(cores))}

    def describe(self, nodes: Iterable[NodeSpec]) -> str:
        """One line for the launcher to print: who runs where, and how the split was chosen."""
        if not self.cores:
            return f"cpus: {len(self.available)} core(s), no node pinned"
        how = "picked for this machine" if self.picked else "from resources.cpus"
        pinned = ", ".join(f"{name} {cpu_list(cores)}" for name, cores in self.cores.items())
        floating = [node.name for node in nodes if node.name not in self.cores]
        line = f"cpus ({how}, {len(self.available)} cores {cpu_list(self.available)}): {pinned}"
        if floating:
            line += f"; {', '.join(floating)} on any core"
        if self.oversubscribed:
            line += "; more cores asked for than this machine has: shares wrap around and overlap"
        return line


def plan_cpus(topology: Topology, available: Sequence[int]) -> CpuSplit:
    """The split of `available` cores among `topology`'s nodes, all on this machine (module docstring)."""
    cores = tuple(sorted(available))
    given = [(node.name, node.resources.cpus) for node in topology.nodes if node.resources.cpus is not None]
    picked = not given
    if picked:
        if len(cores) < 2:
            return CpuSplit({}, cores, picked=True, oversubscribed=False)
        rollout = topology.run.rollout
        trains = rollout is not None and rollout.mode == "train"
        gen = topology.run.generator
        given = _halves(topology.nodes, len(cores), trains=trains, workers=gen.engines * gen.tensor_parallel_size)
    shares, cursor = {}, 0.0
    for name, cpus in given:
        first, last = math.floor(cursor + 1e-9), math.ceil(cursor + cpus - 1e-9) - 1
        shares[name] = tuple(sorted({cores[i % len(cores)] for i in range(first, max(first, last) + 1)}))
        cursor += cpus
    return CpuSplit(shares, cores, picked=picked, oversubscribed=cursor > len(cores) + 1e-9)


def _halves(nodes: Sequence[NodeSpec], count: int, *, trains: bool, workers: int = 1) -> list[tuple[str, float]]:
    """Half of `count` cores for the trainer nodes, half for the generators, evenly within each half;
    all of them for the generators when the run does not train (rollout-only: the trainer only
    dispenses work and gathers groups, and floats), and for the trainers when there is no generator.
    A generator gets at least a core for each of its engines' `workers` (tensor-parallel workers on
    CPU share a core at a third of the speed), as far as the machine has them: its share then
    overlaps the next node's."""
    trainers = [node.name for node in nodes if node.role is Role.TRAINER] if trains else []
    generators = [node.name for node in nodes if node.role is Role.GENERATOR]
    half = count / 2 if trainers and generators else count
    each = half / len(generators) if generators else 0.0
    if workers > 1:  # a one-worker engine works on whatever share the even split gives it
        each = max(each, min(workers, count))
    return [(name, half / len(trainers)) for name in trainers] + [(name, each) for name in generators]
