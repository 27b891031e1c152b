"""A topology built in code: nodes on free loopback ports, a `run` section from keyword overrides.

    builder = TopologyBuilder(folder / "run", name="bench", drain_timeout_s=5)
    builder.run_section(rollout={"tasks": [...], "steps": 3})
    builder.node("trainer", "trainer").node("gen-0", "generator", hardware="compute")
    path = builder.write(folder / "topology.yaml")
    admin = builder.ports()["gen-0"].admin_port

Ports are drawn once, for every node together, the first time they are needed (`ports()`,
`to_dict()`, `write()`), so no two nodes get the same one. A node `behind_proxy` gets a third port,
`listen_port`, where it listens while its peers dial `port` (a `PartitionProxy` forwards one to the
other); a trainer with `rendezvous=True` gets one more, `rendezvous_port`, where a trainer group's
primary serves its ranks' store. The YAML is what `rollart.topology` loads; `topology()` loads it.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rollart.testkit.ports import free_ports
from rollart.topology import Topology, parse_topology


@dataclass(frozen=True)
class NodePorts:
    """The ports one node was given."""

    port: int
    """Where its peers connect (the proxy's, for a node behind one)."""
    admin_port: int
    listen_port: int | None = None
    """Where it listens when behind a proxy."""
    rendezvous_port: int | None = None
    """Where a trainer group's primary serves its ranks' store."""


class TopologyBuilder:
    """Collects a topology's `run` section and nodes; writes it as YAML."""

    def __init__(self, run_dir: Path | str, *, name: str = "test", **run: Any) -> None:
        self.run: dict[str, Any] = {"name": name, "run_dir": run_dir, **run}
        self.nodes: list[dict[str, Any]] = []
        self._behind_proxy: set[str] = set()
        self._rendezvous: set[str] = set()
        self._ports: dict[str, NodePorts] | None = None

    def run_section(self, yaml_text: str = "", /, **keys: Any) -> TopologyBuilder:
        """Set keys of `run:`, replacing those already there; `yaml_text` is keys of `run:` as YAML
        (indented or not), for callers that keep a ready-made block of them."""
        if yaml_text.strip():
            parsed = yaml.safe_load(textwrap.dedent(yaml_text))
            if not isinstance(parsed, dict):
                raise ValueError(f"run_section: expected YAML keys of the run section; got {yaml_text!r}")
            self.run.update(parsed)
        self.run.update(keys)
        return self

    def node(
        self, name: str, role: str, *, behind_proxy: bool = False, rendezvous: bool = False, **fields: Any
    ) -> TopologyBuilder:
        """Add a node (`hardware=`, `host=`, `primary=`... as the topology spells them); `rendezvous`:
        give it a `rendezvous_port` (the primary of a trainer group)."""
        if self._ports is not None:
            raise RuntimeError(f"node {name!r} added after the ports were drawn")
        self.nodes.append({"name": name, "role": role, **fields})
        if behind_proxy:
            self._behind_proxy.add(name)
        if rendezvous:
            self._rendezvous.add(name)
        return self

    def ports(self) -> dict[str, NodePorts]:
        """Each node's ports, drawn together on first use."""
        if self._ports is None:
            wanted = sum(
                2 + (node["name"] in self._behind_proxy) + (node["name"] in self._rendezvous) for node in self.nodes
            )
            free = iter(free_ports(wanted))
            self._ports = {}
            for node in self.nodes:
                name = node["name"]
                port, admin = next(free), next(free)
                listen = next(free) if name in self._behind_proxy else None
                rendezvous = next(free) if name in self._rendezvous else None
                self._ports[name] = NodePorts(port, admin, listen, rendezvous)
        return self._ports

    def to_dict(self) -> dict[str, Any]:
        ports = self.ports()
        nodes = []
        for node in self.nodes:
            given = ports[node["name"]]
            placed = {"port": given.port, "admin_port": given.admin_port}
            if given.listen_port is not None:
                placed["listen_port"] = given.listen_port
            if given.rendezvous_port is not None:
                placed["rendezvous_port"] = given.rendezvous_port
            nodes.append({**node, **placed})
        plain: dict[str, Any] = _plain({"run": self.run, "nodes": nodes})
        return plain

    def to_yaml(self) -> str:
        # Mappings of plain values in flow style on one line (`session: {heartbeat_interval_s: 0.2, ...}`,
        # a node per line), as the hand-written topologies were: readable, and tests may edit the text.
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=1000)

    def write(self, path: Path) -> Path:
        path.write_text(self.to_yaml())
        return path

    def topology(self) -> Topology:
        """The topology loaded from this YAML, as a node would load it."""
        return parse_topology(self.to_yaml())


def _plain(value: Any) -> Any:
    """Paths as strings, so the YAML holds only plain types."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value
