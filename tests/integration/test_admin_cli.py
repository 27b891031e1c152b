"""`rollart status | pause | resume | drain` against a live local training run (real node processes)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import NODES, Cluster, make_cluster, training_yaml
from tests.support import ROOT, http, node_env

pytestmark = pytest.mark.integration


def rollart(cluster: Cluster, *args: str, token: str = "test-token") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "rollart", *args, "--topology", str(cluster.topology)]
    env = node_env(token=token)
    return subprocess.run(command, check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)


def rows(table: str) -> dict[str, list[str]]:
    """The table's rows by node name (columns split on runs of two or more spaces)."""
    lines = table.strip().splitlines()
    return {cells[0]: cells for line in lines[1:] if (cells := re.split(r"\s{2,}", line.strip()))}


DOCUMENTED = set(re.findall(r"`(rollart_[a-z_]+)`", (ROOT / "docs" / "metrics.md").read_text()))
"""Every metric name docs/metrics.md gives."""
ROLE_PREFIX = {
    "trainer": "rollart_trainer_",
    "generator": "rollart_generator_",
    "env-host": "rollart_env_host_",
    "reward-gateway": "rollart_reward_",
}


def exported_metrics(text: str) -> set[str]:
    """The rollart_* sample names of a /metrics page, one per family (counters as NAME_total)."""
    families = text_string_to_metric_families(text)
    suffix = {"counter": "_total", "info": "_info"}
    return {f.name + suffix.get(f.type, "") for f in families if f.name.startswith("rollart_")}


@pytest.mark.timeout(300)
def test_status_pause_resume_and_drain_a_live_run(tmp_path: Path, tiny_model: Path, clusters: list[Cluster]) -> None:
    cluster = make_cluster(clusters, tmp_path, training_yaml(tiny_model, steps=500))
    cluster.start()
    cluster.wait_healthy()
    cluster.wait_status("trainer", lambda s: s["rollout"]["batches"] >= 1, 120, "a first step")

    done = rollart(cluster, "status")
    assert done.returncode == 0, done.stderr
    table = rows(done.stdout)
    header = ["NODE", "ROLE", "STATE", "VERSION", "QUEUES", "BUSY", "LAST", "ERROR"]
    assert done.stdout.splitlines()[0].split() == header
    assert set(table) == set(NODES)
    for name, role in NODES.items():
        assert table[name][1:3] == [role, "running"], table[name]
    assert int(table["trainer"][3]) >= 1 and "buffer=" in table["trainer"][4]
    assert table["gen-compute"][5].endswith("%") and "running=" in table["gen-compute"][4]

    # Every rollart_* metric a live node exports is in the reference page, with its role's own.
    for name, role in NODES.items():
        code, text = http("GET", cluster.ports[name][1], "/metrics")
        assert code == 200
        exported = exported_metrics(text)
        assert exported and exported <= DOCUMENTED, (name, sorted(exported - DOCUMENTED))
        assert any(metric.startswith(ROLE_PREFIX[role]) for metric in exported), (name, sorted(exported))

    # A wrong token: refused, exit 3, and nothing paused.
    wrong = rollart(cluster, "pause", token="not-the-token")
    assert wrong.returncode == 3, (wrong.stdout, wrong.stderr)
    assert "admin token" in wrong.stderr and "HTTP 401" in wrong.stdout
    assert not any(cluster.status(name)["paused"] for name in NODES)

    # Pause: every node says so; after the step in progress (if any), the trainer steps no more
    # and grants no group.
    paused = rollart(cluster, "pause")
    assert paused.returncode == 0, paused.stderr
    assert all(row[2:] == ["ok", "paused"] for row in rows(paused.stdout).values()), paused.stdout
    time.sleep(3)
    before = cluster.status("trainer")["rollout"]
    time.sleep(5)
    after = cluster.status("trainer")["rollout"]
    assert (after["batches"], after["dispenser"]["granted"]) == (before["batches"], before["dispenser"]["granted"])
    assert rows(rollart(cluster, "status").stdout)["env-0"][2] == "paused"

    # Resume: steps again.
    resumed = rollart(cluster, "resume")
    assert resumed.returncode == 0, resumed.stderr
    cluster.wait_status("trainer", lambda s: s["rollout"]["batches"] > after["batches"], 120, "a step after resume")

    # One node only; an unknown node is a usage error.
    one = rollart(cluster, "status", "--node", "env-0")
    assert one.returncode == 0 and set(rows(one.stdout)) == {"env-0"}, one.stdout
    unknown = rollart(cluster, "status", "--node", "nope")
    assert unknown.returncode == 2 and "unknown node 'nope'" in unknown.stderr

    # Drain: every node finishes and exits 0; then nothing answers (exit 1, each named).
    drained = rollart(cluster, "drain")
    assert drained.returncode == 0, drained.stderr
    codes = {name: proc.wait(timeout=60) for name, proc in cluster.procs.items()}
    assert codes == dict.fromkeys(NODES, 0), codes
    gone = rollart(cluster, "status")
    assert gone.returncode == 1
    assert all(row[2] == "unreachable" for row in rows(gone.stdout).values()), gone.stdout
    assert "no answer from" in gone.stderr
