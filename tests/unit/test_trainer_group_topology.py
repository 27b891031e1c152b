"""A trainer that spans hosts in the topology: a primary trainer node and members (`primary:`).

Where each node's ranks sit (`Topology.rank_layout`), every mistake named by its YAML path, and
who talks to whom: the primary is the run's trainer for every peer; a member has no sessions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rollart.errors import ConfigError
from rollart.nodes import TrainerMemberNode, TrainerNode, daemon_for
from rollart.nodes.env_host import EnvHostNode
from rollart.testkit.topology import TopologyBuilder
from rollart.topology import Topology, parse_topology
from rollart.training.spec import RankLayout

FSDP = {"insecure": True, "trainer": {"backend": "fsdp2", "ranks": 2}}  # insecure: hosts beyond loopback, no TLS
NOT_PRIMARY = "only a primary trainer serves a rendezvous (the trainer that names no primary)"


def node(name: str, role: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "role": role, "port": port, "admin_port": port + 100, **extra}


def group(*extra: dict[str, Any], run: dict[str, Any] | None = None) -> str:
    """A member listed before its primary (ranks still count from the primary), a generator, `extra`."""
    nodes = [
        node("trainer-b", "trainer", 7001, primary="trainer"),
        node("trainer", "trainer", 7002, host="10.0.0.1", rendezvous_port=7500),
        node("gen-0", "generator", 7003),
        *extra,
    ]
    return yaml.safe_dump({"run": FSDP if run is None else run, "nodes": nodes}, sort_keys=False)


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_topology(text, "t.yaml")
    return str(caught.value).splitlines()


def test_trainer_group_layout_counts_ranks_from_the_primary() -> None:
    topology = parse_topology(group(node("trainer-c", "trainer", 7004, primary="trainer")))
    assert [n.name for n in topology.trainer_group("trainer-c")] == ["trainer", "trainer-b", "trainer-c"]
    store = {"world_size": 6, "local_ranks": 2, "store_host": "10.0.0.1", "store_port": 7500}
    assert topology.rank_layout("trainer") == RankLayout(first_rank=0, **store)
    assert topology.rank_layout("trainer-b") == RankLayout(first_rank=2, **store)
    assert topology.rank_layout("trainer-c") == RankLayout(first_rank=4, **store)


def test_trainer_group_of_one_is_the_plain_trainer() -> None:
    topology = parse_topology(yaml.safe_dump({"run": FSDP, "nodes": [node("trainer", "trainer", 7001)]}))
    assert topology.rank_layout("trainer") == RankLayout(world_size=2, local_ranks=2, store_port=0)
    with pytest.raises(ConfigError, match="'trainer-x' is a generator, not a trainer"):
        parse_topology(group(node("trainer-x", "generator", 7004))).rank_layout("trainer-x")


def test_trainer_group_mistakes_are_named_by_yaml_path() -> None:
    text = group(
        node("gen-1", "generator", 7004, primary="trainer", rendezvous_port=7600),
        node("trainer-c", "trainer", 7005, primary="trainr"),
        node("trainer-d", "trainer", 7006, primary="trainer-d"),
        node("trainer-e", "trainer", 7007, primary="gen-0"),
        node("trainer-f", "trainer", 7008, primary="trainer-b", rendezvous_port=7601),
        node("trainer-g", "trainer", 7009),
    )
    assert errors(text) == [
        "t.yaml: nodes[8].role: a second trainer: a run has one (here 'trainer', nodes[1]); "
        "to run more of its ranks on this node, set primary: trainer",
        "t.yaml: nodes[3].primary: only a trainer node names a primary (the trainer whose ranks it runs); "
        "this is a generator",
        f"t.yaml: nodes[3].rendezvous_port: {NOT_PRIMARY}",
        "t.yaml: nodes[4].primary: unknown node 'trainr'; did you mean 'trainer'?",
        "t.yaml: nodes[5].primary: a trainer cannot be its own primary",
        "t.yaml: nodes[6].primary: 'gen-0' is a generator; a primary is a trainer node",
        "t.yaml: nodes[7].primary: 'trainer-b' is a member itself (of 'trainer'); name the group's primary",
        f"t.yaml: nodes[7].rendezvous_port: {NOT_PRIMARY}",
    ]


def test_trainer_group_needs_fsdp2_and_a_rendezvous_port() -> None:
    run = {"insecure": True, "trainer": {"backend": "torch"}}
    text = group(run=run).replace("rendezvous_port: 7500", "host: 10.0.0.1")
    assert errors(text) == [
        "t.yaml: nodes[1].rendezvous_port: missing: the ranks of its members (trainer-b) rendezvous there",
        "t.yaml: run.trainer.backend: a group of trainer nodes (trainer, trainer-b) needs fsdp2; got 'torch'",
    ]


def test_trainer_group_rendezvous_port_is_checked_like_every_port() -> None:
    clash = group().replace("rendezvous_port: 7500", "rendezvous_port: 7002")  # its own session port
    assert errors(clash) == ["t.yaml: nodes[1].rendezvous_port: port 7002 on 10.0.0.1 is already used by nodes[1].port"]
    far = group().replace("rendezvous_port: 7500", "rendezvous_port: 70000")
    assert errors(far) == ["t.yaml: nodes[1].rendezvous_port: expected an integer from 1 to 65535; got 70000"]


def sessions(tmp_path: Path) -> Topology:
    builder = TopologyBuilder(tmp_path, trainer=FSDP["trainer"])
    builder.node("trainer-b", "trainer", primary="trainer")
    builder.node("trainer", "trainer", rendezvous_port=7500).node("gen-0", "generator").node("env-0", "env-host")
    return builder.node("reward", "reward-gateway").topology()


async def test_trainer_group_members_have_no_sessions_and_peers_talk_to_the_primary(tmp_path: Path) -> None:
    topology = sessions(tmp_path)
    assert daemon_for(topology.node("trainer-b")) is TrainerMemberNode
    assert daemon_for(topology.node("trainer")) is TrainerNode
    member = TrainerMemberNode(topology, topology.node("trainer-b"), secret=b"s", admin_token=None)
    primary = TrainerNode(topology, topology.node("trainer"), secret=b"s", admin_token=None)
    env_host = EnvHostNode(topology, topology.node("env-0"), secret=b"s", admin_token=None)
    assert member.clients == {} and list(primary.clients) == ["gen-0"]
    assert sorted(env_host.clients) == ["gen-0", "reward", "trainer"]
    status = member.status()
    assert status["primary"] == "trainer" and status["ranks"] == {} and status["world_size"] == 4
    assert member.progress() == "ranks 2-3 of 4 (primary trainer)"
