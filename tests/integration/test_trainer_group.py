"""A trainer that spans hosts, on one machine: a primary trainer and a member trainer node on loopback.

The member is a real node process (`rollart.node`, `primary: trainer` in the topology) whose rank
joins the primary's through the rendezvous store the primary serves; on CPU (gloo) the group must
train exactly like two ranks of one node, and a whole training run with a group must train, push,
checkpoint and stop with every node exiting 0 (the member once the primary stops its ranks).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rollart.rundir import RunDir, read_jsonl
from rollart.testkit.batches import random_batch
from rollart.testkit.topology import TopologyBuilder
from rollart.topology import load_topology
from rollart.training.fsdp.engine import FSDPTrainer
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec
from tests.integration.cluster import HARDWARE, NODES, Cluster, make_cluster, training_yaml
from tests.support import ROOT, healthy, http, node_env, start_node, wait_for, write_topology

pytestmark = pytest.mark.integration

GROUP = {"trainer": {"rendezvous": True}, "trainer-b": {"primary": "trainer"}}
"""`fields` of `write_topology` that make trainer-b a member of trainer's group."""
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
    assert "the primary trainer stopped its ranks" in log and "ranks.group_failed" not in log

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


# slow: minutes of the default test run on 2 cores; CI runs it (bin/test --all)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_group_training_run_checkpoints_and_every_node_exits_cleanly(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    """Two trainer nodes of one rank each: the primary trains, pushes and checkpoints (every rank
    writes its shard into the run folder), the member shows its rank, and a stop drains all."""
    yaml = training_yaml(tiny_model, steps=STEPS, checkpoint_every=1, trainer="backend: fsdp2")
    # The member waits for the primary to stop its ranks for its drain timeout less a second; the
    # primary's stop (a checkpoint with every rank, then `stop`) took over 4 s on a loaded 2-core CI.
    yaml += "  drain_timeout_s: 20\n"
    cluster = make_cluster(clusters, tmp_path, yaml, nodes=NODES | {"trainer-b": "trainer"}, fields=GROUP)
    cluster.start()
    cluster.wait_healthy()
    member = cluster.status("trainer-b")
    assert member["sessions"] == {"outgoing": [], "incoming": []} and member["world_size"] == 2, member
    done = cluster.wait_status("trainer", lambda s: s["done"], 240, "the trainer to finish its steps")
    assert done["rollout"]["version"] == done["rollout"]["batches"] == STEPS
    steps = [line for line in cluster.metrics() if "step" in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    trained = [line for line in steps if line["tokens"] > 0]  # a batch without signal takes no step
    assert all(line["state_bytes_r1"] > 0 for line in trained), steps  # rank 1: the member's
    latest = RunDir(cluster.run_dir).latest_checkpoint()
    assert latest is not None and RunDir(cluster.run_dir).latest_step() == STEPS
    # Whether or not a batch had signal, every checkpoint holds the member's shard, written by its rank.
    assert sorted(path.name for path in (latest / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    rank_pid = int(cluster.status("trainer-b")["ranks"]["1"])
    assert cluster.stop() == dict.fromkeys([*NODES, "trainer-b"], 0)
    assert not Path(f"/proc/{rank_pid}").exists() or "zombie" in Path(f"/proc/{rank_pid}/status").read_text()
    assert [event["code"] for event in cluster.events("trainer-b", "trainer_member.rank_exited")] == [0]
    assert not cluster.events("trainer-b", "ranks.group_failed", "trainer_member.stopping_ranks")


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


def rollart_run(topology: Path) -> subprocess.Popen[str]:
    """`rollart run TOPOLOGY`, with the secret and admin token the launcher makes for the run."""
    env = {k: v for k, v in node_env().items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
    command = [sys.executable, "-m", "rollart.cli", "run", str(topology)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# slow: minutes of the default test run on 2 cores; CI runs it (bin/test --all)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_group_under_rollart_run_trains_to_the_end_and_stops_cleanly(tmp_path: Path, tiny_model: Path) -> None:
    """The local launcher starts the member like any node; the run ends when the primary is done."""
    nodes = NODES | {"trainer-b": "trainer"}
    run_yaml = training_yaml(tiny_model, steps=2, trainer="backend: fsdp2")
    run_yaml += "  drain_timeout_s: 20\n"  # the primary's close stopped the ranks 3.3 s after the drain here
    topology, _ = write_topology(tmp_path, nodes, hardware=HARDWARE, extra_run=run_yaml, fields=GROUP)
    proc = rollart_run(topology)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "trainer finished the run" in out and f"all {len(nodes)} nodes stopped cleanly" in out, out
    assert [line["step"] for line in read_jsonl(RunDir(tmp_path / "run").metrics) if "step" in line] == [1, 2]
    member_log = RunDir(tmp_path / "run").node_log("trainer-b").read_text()
    assert '"code": 0, "event": "trainer_member.rank_exited"' in member_log and "stopping_ranks" not in member_log


def test_trainer_group_rendezvous_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    nodes = {"trainer": "trainer", "trainer-b": "trainer"}
    topology, _ = write_topology(tmp_path, nodes, extra_run="  trainer: {backend: fsdp2}\n", fields=GROUP)
    port = load_topology(topology).node("trainer").rendezvous_port
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        proc = rollart_run(topology)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert f"nodes[0].rendezvous_port: port {port} on 127.0.0.1 is not free" in out, out


# slow: minutes of the default test run on 2 cores; CI runs it (bin/test --all)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_group_member_killed_mid_run_is_restarted_and_the_run_completes(
    tmp_path: Path, tiny_model: Path
) -> None:
    """kill -9 of the member: its rank goes with it, the primary's next step fails and the primary
    restarts from its last checkpoint, the restarted member's rank waits for that new group rather
    than rejoin the broken one, and the run trains to its last step."""
    nodes = NODES | {"trainer-b": "trainer"}
    run_yaml = training_yaml(tiny_model, steps=4, checkpoint_every=1, trainer="backend: fsdp2, rank_timeout_s: 90")
    topology, ports = write_topology(tmp_path, nodes, hardware=HARDWARE, extra_run=run_yaml, fields=GROUP)
    metrics = RunDir(tmp_path / "run").metrics
    proc = rollart_run(topology)
    try:
        wait_for(lambda: metrics.exists() and any("step" in line for line in read_jsonl(metrics)), 180, "step 1")
        os.kill(int(http("GET", ports["trainer-b"][1], "/status")[1]["pid"]), signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "node trainer-b was killed by SIGKILL" in out and "node trainer exited with code 1" in out, out
    steps = [line["step"] for line in read_jsonl(metrics) if "step" in line]
    assert steps[-1] == 4 and set(steps) == {1, 2, 3, 4}, steps
