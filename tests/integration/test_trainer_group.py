"""A trainer that spans hosts, on one machine: a primary trainer and a member trainer node on loopback.

The member is a real node process (`rollart.node`, `primary: trainer` in the topology) whose rank
joins the primary's through the rendezvous store the primary serves; on CPU (gloo) the group must
train exactly like two ranks of one node, and a whole training run with a group must train, push,
checkpoint and stop with every node exiting 0 (the member once the primary stops its ranks).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from rollart.engines.fsdp import FSDPTrainer
from rollart.engines.training import TrainerSpec, build_training_engine
from rollart.rundir import RunDir
from rollart.testkit.topology import TopologyBuilder
from tests.batches import random_batch
from tests.integration.cluster import NODES, Cluster, make_cluster, training_yaml
from tests.support import healthy, http, start_node, wait_for

pytestmark = pytest.mark.integration

SPEC: dict[str, Any] = {"backend": "fsdp2", "lr": 1e-3, "micro_batch_size": 3, "device": "cpu", "threads": 1}
STEPS = 3


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def train(engine: FSDPTrainer) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    stats = [engine.train_step(random_batch(step, rows=7), version=step + 1) for step in range(STEPS)]
    return stats, engine.export_weights()


def test_trainer_group_two_nodes_match_two_ranks_in_one_node(tmp_path: Path, tiny_model: Path) -> None:
    """The member node starts first (its rank waits for the primary's store); the primary is an
    engine in this process. Same batches, same weights as 2 ranks in one node; when the primary
    stops its ranks, the member drains and exits 0."""
    builder = TopologyBuilder(tmp_path / "run", drain_timeout_s=10).run_section(
        training_yaml(tiny_model, steps=STEPS), trainer=SPEC | {"ranks": 1}
    )
    builder.node("trainer", "trainer", rendezvous=True).node("trainer-b", "trainer", primary="trainer")
    topology = builder.topology()
    member = start_node(builder.write(tmp_path / "topology.yaml"), "trainer-b", tmp_path / "trainer-b.log")
    admin = builder.ports()["trainer-b"].admin_port
    try:
        wait_for(lambda: member.poll() is None and healthy(admin), 60, "the member node healthy")
        primary = FSDPTrainer(tiny_model, topology.run.trainer, seed=0, layout=topology.rank_layout("trainer"))
        try:
            assert primary.describe()["ranks"] == 2
            _, status = http("GET", admin, "/status")
            assert status["primary"] == "trainer" and list(status["ranks"]) == ["1"], status
            group_stats, group_weights = train(primary)
        finally:
            primary.close()
        assert member.wait(timeout=30) == 0, (tmp_path / "trainer-b.log").read_text()[-3000:]
    finally:
        if member.poll() is None:
            member.kill()
            member.wait()
    log = (tmp_path / "trainer-b.log").read_text()
    assert "the primary trainer stopped its ranks" in log and "fsdp.rank_group_failed" not in log

    one_node = build_training_engine(TrainerSpec(**(SPEC | {"ranks": 2})), tiny_model, seed=0)
    assert isinstance(one_node, FSDPTrainer)
    try:
        node_stats, node_weights = train(one_node)
    finally:
        one_node.close()
    for step, (group, node) in enumerate(zip(group_stats, node_stats, strict=True)):
        for key in ("loss", "grad_norm", "tokens"):
            assert group[key] == pytest.approx(node[key], rel=1e-5), (step, key)
    assert list(group_weights) == list(node_weights)
    for name, tensor in node_weights.items():
        assert relative(group_weights[name], tensor) < 1e-5, name


@pytest.mark.timeout(300)
def test_trainer_group_training_run_checkpoints_and_every_node_exits_cleanly(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    """Two trainer nodes of one rank each: the primary trains, pushes and checkpoints (every rank
    writes its shard into the run folder), the member shows its rank, and a stop drains all."""
    yaml = training_yaml(tiny_model, steps=STEPS, checkpoint_every=1, trainer="backend: fsdp2")
    fields = {"trainer": {"rendezvous": True}, "trainer-b": {"primary": "trainer"}}
    cluster = make_cluster(clusters, tmp_path, yaml, nodes=NODES | {"trainer-b": "trainer"}, fields=fields)
    cluster.start()
    cluster.wait_healthy()
    member = cluster.status("trainer-b")
    assert member["sessions"] == {"outgoing": [], "incoming": []} and member["world_size"] == 2, member
    done = cluster.wait_status("trainer", lambda s: s["done"], 240, "the trainer to finish its steps")
    assert done["rollout"]["version"] == done["rollout"]["batches"] == STEPS
    steps = [line for line in cluster.metrics() if "step" in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    trained = [line for line in steps if line["tokens"] > 0]
    assert trained and all(line["state_bytes_r1"] > 0 for line in trained), steps  # rank 1: the member's
    latest = RunDir(cluster.run_dir).latest_checkpoint()
    assert latest is not None and RunDir(cluster.run_dir).latest_step() == STEPS
    assert sorted(path.name for path in (latest / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    rank_pid = int(cluster.status("trainer-b")["ranks"]["1"])
    assert cluster.stop() == dict.fromkeys([*NODES, "trainer-b"], 0)
    assert not Path(f"/proc/{rank_pid}").exists() or "zombie" in Path(f"/proc/{rank_pid}/status").read_text()
    assert not cluster.events("trainer-b", "fsdp.rank_group_failed")


def test_trainer_group_member_fails_when_the_primary_dies(tmp_path: Path, tiny_model: Path) -> None:
    """The primary's ranks vanish (its node was killed): the member's rank sees the group break and
    the member exits non-zero, for its restart policy to start it again."""
    builder = TopologyBuilder(tmp_path / "run", drain_timeout_s=10).run_section(
        training_yaml(tiny_model, steps=STEPS), trainer=SPEC | {"ranks": 1, "rank_timeout_s": 30}
    )
    builder.node("trainer", "trainer", rendezvous=True).node("trainer-b", "trainer", primary="trainer")
    topology = builder.topology()
    member = start_node(builder.write(tmp_path / "topology.yaml"), "trainer-b", tmp_path / "trainer-b.log")
    try:
        primary = FSDPTrainer(tiny_model, topology.run.trainer, seed=0, layout=topology.rank_layout("trainer"))
        primary.train_step(random_batch(0, rows=5), version=1)
        for process in primary.ranks.processes.values():
            process.kill()  # as when the primary's node is killed: its ranks leave without a word
        primary.close()
        code = member.wait(timeout=60)
    except subprocess.TimeoutExpired:
        member.kill()
        raise
    assert code == 1, (tmp_path / "trainer-b.log").read_text()[-3000:]
    assert "the trainer group is broken" in (tmp_path / "trainer-b.log").read_text()
