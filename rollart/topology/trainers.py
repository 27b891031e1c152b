"""Trainer groups: one trainer that spans hosts, written as several trainer nodes of the topology.

A group is a primary trainer node (no `primary:`) and the member nodes that name it
(`primary: NAME`). The primary is *the* trainer of the run: it owns the task dispenser, the sample
buffer, the sessions with env-hosts and generators, the policy version, and rank 0. A member only
runs `run.trainer.ranks` more rank processes of the same FSDP2 process group; its ranks find the
others through the rendezvous store the primary serves at its `host`:`rendezvous_port`. No node opens
a session to a member, and a member opens none. Ranks are numbered primary first, then the members
in the topology's order, `run.trainer.ranks` each.

A run has one trainer (group): exactly one trainer node without `primary`. `check_trainer_groups`
runs when the topology loads and names YAML paths; the rest answers questions nodes and launchers
ask of a loaded topology (through `Topology`'s methods of the same names).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from rollart.errors import ConfigError
from rollart.training.registry import TRAINING_BACKENDS
from rollart.training.spec import RankLayout

if TYPE_CHECKING:
    from rollart.topology import NodeSpec, Topology

TRAINER = "trainer"
"""`Role.TRAINER.value`: `rollart.topology` defines the enum and imports this module, which therefore
imports its types only for the type checker."""


def trainer_group(topology: Topology, name: str) -> list[NodeSpec]:
    """The group trainer node `name` belongs to: its primary first, then the members in file order."""
    node = topology.node(name)
    if node.role.value != TRAINER:
        raise ConfigError(f"{topology.source}: node {name!r} is a {node.role.value}, not a trainer")
    primary = topology.node(node.primary) if node.primary is not None else node
    return [primary, *(other for other in topology.nodes if other.primary == primary.name)]


def rank_layout(topology: Topology, name: str) -> RankLayout:
    """Where trainer node `name`'s ranks sit in its group: `run.trainer.ranks` each, numbered from the
    primary's; the store on the primary's host, at its `rendezvous_port` (unset: any free port,
    which only ranks on the primary's own host can find)."""
    group = trainer_group(topology, name)
    ranks = topology.run.trainer.ranks
    primary = group[0]
    index = next(i for i, node in enumerate(group) if node.name == name)
    return RankLayout(
        world_size=ranks * len(group),
        first_rank=ranks * index,
        local_ranks=ranks,
        store_host=primary.host,
        store_port=primary.rendezvous_port or 0,
    )


def check_trainer_groups(topology: Topology) -> list[tuple[str, str]]:
    """What is wrong with the topology's trainer nodes, as (YAML path, problem)."""
    problems: list[tuple[str, str]] = []
    index = {node.name: i for i, node in reversed(list(enumerate(topology.nodes)))}
    trainers = [node.name for node in topology.nodes if node.role.value == TRAINER]
    primaries = [name for name in trainers if topology.nodes[index[name]].primary is None]
    for name in primaries[1:]:
        problem = (
            f"a second trainer: a run has one (here {primaries[0]!r}, nodes[{index[primaries[0]]}]); "
            f"to run more of its ranks on this node, set primary: {primaries[0]}"
        )
        problems.append((f"nodes[{index[name]}].role", problem))
    members: dict[str, list[str]] = {}
    for i, node in enumerate(topology.nodes):
        if node.primary is not None:
            if (wrong := _primary_problem(topology, node, index, trainers)) is not None:
                problems.append((f"nodes[{i}].primary", wrong))
            else:
                members.setdefault(node.primary, []).append(node.name)
        if node.rendezvous_port is not None and (node.role.value != TRAINER or node.primary is not None):
            problem = "only a primary trainer serves a rendezvous (the trainer that names no primary)"
            problems.append((f"nodes[{i}].rendezvous_port", problem))
    for primary, names in members.items():
        at = f"nodes[{index[primary]}].rendezvous_port"
        if topology.nodes[index[primary]].rendezvous_port is None:
            problems.append((at, f"missing: the ranks of its members ({', '.join(names)}) rendezvous there"))
        if not TRAINING_BACKENDS[topology.run.trainer.backend].node_groups:  # known: checked before
            takes = ", ".join(name for name, record in TRAINING_BACKENDS.items() if record.node_groups)
            problem = f"a group of trainer nodes ({primary}, {', '.join(names)}) needs {takes}"
            problems.append(("run.trainer.backend", f"{problem}; got {topology.run.trainer.backend!r}"))
    return problems


def _primary_problem(topology: Topology, node: NodeSpec, index: dict[str, int], trainers: list[str]) -> str | None:
    """What is wrong with the `primary:` of `node` (which has one), or None."""
    primary = node.primary or ""
    if node.role.value != TRAINER:
        return f"only a trainer node names a primary (the trainer whose ranks it runs); this is a {node.role.value}"
    if primary == node.name:
        return "a trainer cannot be its own primary"
    if primary not in index:
        hint = difflib.get_close_matches(primary, trainers, n=1)
        return f"unknown node {primary!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
    named = topology.nodes[index[primary]]
    if named.role.value != TRAINER:
        return f"{primary!r} is a {named.role.value}; a primary is a trainer node"
    if named.primary is not None:
        return f"{primary!r} is a member itself (of {named.primary!r}); name the group's primary"
    return None
