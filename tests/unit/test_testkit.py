"""rollart/testkit's topology builder: what it writes is what the f-string YAML it replaced said."""

from __future__ import annotations

import socket
from pathlib import Path

from rollart.testkit.ports import LOWEST, RANGE_FILE, free_ports
from rollart.testkit.topology import TopologyBuilder
from rollart.topology import load_topology


def test_the_builder_places_nodes_on_distinct_free_ports_and_loads(tmp_path: Path) -> None:
    builder = TopologyBuilder(tmp_path / "run", name="kit", drain_timeout_s=5, restart={"policy": "stop-all"})
    builder.run_section("  restart: {policy: never}\n  log_level: debug\n", reward_pool={"max_workers": 1})
    builder.node("trainer", "trainer").node("gen-0", "generator", hardware="compute", behind_proxy=True)
    topology = load_topology(builder.write(tmp_path / "topology.yaml"))
    ports = builder.ports()
    drawn = [p for given in ports.values() for p in (given.port, given.admin_port, given.listen_port) if p]
    assert len(drawn) == len(set(drawn)) == 5
    gen = topology.node("gen-0")
    assert (gen.port, gen.listen_port, gen.admin_port) == (
        ports["gen-0"].port,
        ports["gen-0"].listen_port,
        ports["gen-0"].admin_port,
    )
    assert ports["trainer"].listen_port is None and topology.node("trainer").port == ports["trainer"].port
    assert topology.run.name == "kit" and topology.run_dir() == tmp_path / "run"
    assert topology.restart_policy(gen).policy == "never"  # the later keys replace the earlier ones
    assert topology.run.log_level == "debug" and topology.run.reward_pool.max_workers == 1


def test_free_ports_come_from_below_the_ephemeral_range_and_bind() -> None:
    """The kernel hands ephemeral ports to `bind(0)` and outgoing connections (srun's among them);
    a node's port from there could be taken before the node binds it."""
    ports = free_ports(16)
    assert len(set(ports)) == 16
    start = int(RANGE_FILE.read_text().split()[0]) if RANGE_FILE.exists() else None
    for port in ports:
        if start is not None:
            assert LOWEST <= port < start
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
