"""GPUs in the topology: which kinds there are, the rules a node's GPUs follow, and which devices of its
host each node gets.

    resources: {gpus: 4, gpu_type: H100}                     # the next 4 free GPUs of its host
    resources: {gpus: 2, gpu_type: H20, gpu_ids: [6, 7]}     # exactly these
    resources: {gpus: 1, gpu_ids: [0], share_gpus: true}    # GPU 0, which another node that says
                                                             # share_gpus may hold too

Kinds: `GPU_MEMORY_MIB` holds the memory of each card `gpu_type` may name, as `nvidia-smi
--query-gpu=memory.total` reports it (what vLLM's `gpu_memory_utilization` is a fraction of), a little
below the marketed size: an "80 GB" H100 reports 81,559 MiB, 79.6 GiB. Another card is given by its
memory (`gpu_memory_gb`, which also overrides a listed kind's).

Rules, checked when the topology loads (`check_gpus`, problems as YAML paths): `gpu_ids` lists `gpus`
distinct ids; a trainer node runs one rank per GPU (`run.trainer.ranks` equals its `gpus` when it has
any) and a megatron group's ranks divide into tensor x pipeline parallel; a generator node has
`engines` x `tensor_parallel_size` GPUs when it has any; two nodes on one host may name the same
GPU only when both say `share_gpus`.

Placement (`plan_gpus`): on each host, the nodes with `gpu_ids` hold those; every other node with
GPUs gets the lowest ids nobody holds yet, in topology order, so a node never shares a GPU it did not
ask to. `rollart check` shows the plan; the local launcher applies it (`rollart.launch.gpus`) with
every node on its one machine. Imports nothing of `rollart` at run time.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from typing import TYPE_CHECKING

from rollart.generation.registry import backend as generation_backend

if TYPE_CHECKING:
    from rollart.topology import NodeSpec, Topology

MIB, GIB = 1024**2, 1024**3

GPU_MEMORY_MIB: dict[str, int] = {
    "B200": 183359,
    "H200": 143771,
    "H100": 81559,
    "H800": 81559,
    "H20": 97871,
    "A100-80G": 81920,
    "A800-80G": 81920,
    "A100-40G": 40960,
    "L40S": 46068,
    "L40": 46068,
    "L20": 46068,
    "A10": 23028,
    "L4": 23034,
    "RTX4090": 24564,
}
"""GPU kind -> memory of one in MiB, as nvidia-smi reports it (H100, H800: the 80 GB SXM cards)."""

_ALIASES = {"A100": "A100-80G", "A800": "A800-80G", "4090": "RTX4090", "RTX-4090": "RTX4090"}
"""Other spellings: a bare A100 or A800 is the 80 GB card."""

_THIS_MACHINE = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}
"""Host names that all mean the machine the node runs on: one pool of GPUs."""


def canonical_kind(kind: str) -> str | None:
    """The table's name for `kind` (any case, a few aliases), or None when it is not in the table."""
    upper = kind.strip().upper()
    upper = _ALIASES.get(upper, upper)
    return upper if upper in GPU_MEMORY_MIB else None


def gpu_memory_gib(kind: str | None, override_gb: float | None) -> float | None:
    """Memory of one GPU in GiB: `override_gb` when given, else the kind's, else None (not known)."""
    if override_gb is not None:
        return override_gb
    name = canonical_kind(kind) if kind is not None else None
    return GPU_MEMORY_MIB[name] * MIB / GIB if name is not None else None


def host_key(host: str) -> str:
    """Which GPU pool a node's `host` is: every loopback and wildcard name is this machine."""
    return "localhost" if host in _THIS_MACHINE else host


def id_list(ids: tuple[int, ...] | list[int]) -> str:
    """GPU ids as a CUDA-style list with runs collapsed for reading: (0, 1, 2, 3, 6) -> `0-3,6`."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def plan_gpus(topology: Topology, *, one_host: bool = False) -> dict[str, tuple[int, ...]]:
    """Node name -> the ids of the GPUs it gets on its host (empty without GPUs); `one_host`: every node
    on one machine, whatever its `host` says (the local launcher)."""
    hosts: dict[str, list[NodeSpec]] = defaultdict(list)
    for node in topology.nodes:
        hosts["here" if one_host else host_key(node.host)].append(node)
    plan: dict[str, tuple[int, ...]] = {}
    for nodes in hosts.values():
        held = {i for node in nodes if node.resources.gpu_ids is not None for i in node.resources.gpu_ids}
        for node in nodes:
            wanted = node.resources.gpus
            if node.resources.gpu_ids is not None:
                plan[node.name] = tuple(node.resources.gpu_ids)
                continue
            free = (i for i in range(len(held) + wanted + 1) if i not in held)
            plan[node.name] = tuple(next(free) for _ in range(wanted))
            held.update(plan[node.name])
    return plan


def check_gpus(topology: Topology) -> list[tuple[str, str]]:
    """What is wrong with the topology's GPUs, as (YAML path, problem)."""
    problems: list[tuple[str, str]] = []
    run = topology.run
    group_sizes = {node.name: sum(1 for n in topology.nodes if n.primary == node.name) + 1 for node in topology.nodes}
    for i, node in enumerate(topology.nodes):
        at, res = f"nodes[{i}].resources", node.resources
        if res.gpu_type is not None and canonical_kind(res.gpu_type) is None and res.gpu_memory_gb is None:
            problems.append((f"{at}.gpu_type", _unknown_kind(res.gpu_type)))
        if res.gpu_memory_gb is not None and res.gpu_memory_gb <= 0:
            problems.append((f"{at}.gpu_memory_gb", f"expected a value > 0; got {res.gpu_memory_gb}"))
        if res.gpu_ids is not None:
            if len(res.gpu_ids) != res.gpus:
                problem = f"lists {len(res.gpu_ids)} GPU(s) but resources.gpus is {res.gpus}; give one id per GPU"
                problems.append((f"{at}.gpu_ids", problem))
            if len(set(res.gpu_ids)) != len(res.gpu_ids) or min(res.gpu_ids, default=0) < 0:
                problems.append((f"{at}.gpu_ids", f"expected distinct ids >= 0; got {res.gpu_ids}"))
        if res.gpus == 0:
            continue
        if node.role.value == "trainer" and run.trainer.ranks != res.gpus:
            problem = (
                f"trainer {node.name} has {res.gpus} GPU(s) but run.trainer.ranks is {run.trainer.ranks}: one rank "
                f"per GPU; set ranks: {res.gpus} (backend fsdp2 or megatron) or gpus: {run.trainer.ranks}"
            )
            problems.append((f"{at}.gpus", problem))
        if node.role.value == "generator" and not generation_backend(run.generator.backend).simulated:
            engines, tp = run.generator.engines, run.generator.tensor_parallel_size
            if res.gpus != engines * tp:
                problem = (
                    f"generator {node.name} has {res.gpus} GPU(s) but its engines need run.generator.engines x "
                    f"tensor_parallel_size = {engines} x {tp} = {engines * tp}"
                )
                problems.append((f"{at}.gpus", problem))
    trainer = run.trainer
    if trainer.backend == "megatron":
        split = trainer.tensor_parallel * trainer.pipeline_parallel
        primary = next((n for n in topology.nodes if n.role.value == "trainer" and n.primary is None), None)
        world = trainer.ranks * group_sizes.get(primary.name, 1) if primary is not None else trainer.ranks
        if world % split and trainer.ranks % trainer.tensor_parallel == 0:  # else run.trainer.tensor_parallel says it
            problem = (
                f"the trainer's {world} rank(s) do not divide into tensor_parallel x pipeline_parallel = "
                f"{trainer.tensor_parallel} x {trainer.pipeline_parallel} = {split}"
            )
            problems.append(("run.trainer.ranks", problem))
    return problems + _overlaps(topology)


def _overlaps(topology: Topology) -> list[tuple[str, str]]:
    """Two nodes of one host that name the same GPU, where not both say share_gpus."""
    problems: list[tuple[str, str]] = []
    holders: dict[tuple[str, int], list[tuple[int, NodeSpec]]] = defaultdict(list)
    for i, node in enumerate(topology.nodes):
        for gpu in dict.fromkeys(node.resources.gpu_ids or ()):
            key = (host_key(node.host), gpu)
            for j, other in holders[key]:
                if not (node.resources.share_gpus and other.resources.share_gpus):
                    problem = (
                        f"GPU {gpu} on {node.host} is already given to {other.name} (nodes[{j}]); two nodes share "
                        "a GPU only when both set resources.share_gpus: true"
                    )
                    problems.append((f"nodes[{i}].resources.gpu_ids", problem))
                    break
            holders[key].append((i, node))
    return problems


def _unknown_kind(kind: str) -> str:
    hint = difflib.get_close_matches(kind.upper(), GPU_MEMORY_MIB, n=1)
    known = ", ".join(GPU_MEMORY_MIB)
    return f"unknown GPU kind {kind!r} (known: {known}); or give resources.gpu_memory_gb" + (
        f"; did you mean {hint[0]!r}?" if hint else ""
    )
