"""Where a Slurm job's nodes run: each node's host from the allocation, and the topology rewritten
with those hosts (`rollart slurm-run`'s first step; the supervisor is `rollart/launch/slurm.py`).

A het-job component's nodes are laid over its hosts as Slurm placed its tasks
(`SLURM_TASKS_PER_NODE_HET_GROUP_<g>`), each host's address read with `scontrol show node`. The
topology so resolved is written beside the original; nodes Slurm placed on one host that the
topology gave the same port get the next free one (session, admin and rendezvous ports alike).
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from rollart.errors import ConfigError
from rollart.topology import load_topology

if TYPE_CHECKING:
    from rollart.launch.slurm import Placement

PORT_KEYS = ("port", "admin_port", "rendezvous_port")
"""A node's ports that two nodes on one host may not share (a trainer group's primary has the last)."""


def expand_counts(spec: str) -> list[int]:
    """`SLURM_TASKS_PER_NODE` ("2(x3),1") as one count per host ([2, 2, 2, 1])."""
    counts = []
    for part in spec.split(","):
        if m := re.fullmatch(r"(\d+)\(x(\d+)\)", part):
            counts += [int(m.group(1))] * int(m.group(2))
        else:
            counts.append(int(part))
    return counts


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout


def hostnames(nodelist: str) -> list[str]:
    return _scontrol("show", "hostnames", nodelist).split()


def node_address(host: str) -> str:
    """A Slurm node's address (`NodeAddr`), which other nodes connect to."""
    m = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", "-o", host))
    return m.group(1) if m else host


def group_env(env: dict[str, str], key: str, group: int, groups: int) -> str:
    """A Slurm variable of one het-job component (plain name when the job has one component)."""
    name = f"{key}_HET_GROUP_{group}" if groups > 1 else key
    if name not in env:
        raise ConfigError(f"{name} is not set: run this inside the job that `rollart slurm` wrote (sbatch)")
    return env[name]


def resolve_hosts(table: list[Placement], env: dict[str, str]) -> dict[str, str]:
    """Each node's Slurm host: a component's nodes laid over its hosts as Slurm placed its tasks."""
    groups = max(p.group for p in table) + 1
    hosts: dict[str, str] = {}
    for g in range(groups):
        names = [p.name for p in table if p.group == g]
        slots = [
            host
            for host, count in zip(
                hostnames(group_env(env, "SLURM_JOB_NODELIST", g, groups)),
                expand_counts(group_env(env, "SLURM_TASKS_PER_NODE", g, groups)),
                strict=False,
            )
            for _ in range(count)
        ]
        if len(slots) < len(names):
            raise ConfigError(f"component {g} has {len(slots)} task slots for {len(names)} nodes: {names}")
        hosts.update(zip(names, slots, strict=False))
    return hosts


def write_resolved(topology_path: Path, addresses: dict[str, str], job_id: str) -> tuple[Path, list[str]]:
    """The topology with each node's host set to its address, beside the original (relative paths
    in it keep working), and the port moves that made it valid: nodes Slurm placed on one host that
    the topology gave the same port (session, admin or rendezvous) get the next free one, in file order.
    Checked by loading it, so anything else wrong is a clear error before a node starts."""
    raw = yaml.safe_load(topology_path.read_text())
    used: dict[str, set[int]] = collections.defaultdict(set)
    moves = []
    for node in raw["nodes"]:
        host = node["host"] = addresses[node["name"]]
        for key in (key for key in PORT_KEYS if node.get(key) is not None):
            port = node[key]
            while port in used[host]:
                port += 1
            if port != node[key]:
                moves.append(f"{node['name']}: {key} {node[key]} -> {port} (taken on {host})")
                node[key] = port
            used[host].add(port)
    out = topology_path.with_name(f".{topology_path.stem}.slurm-{job_id}.yaml")
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    load_topology(out)
    return out, moves
