"""`rollart slurm`'s script and the supervisor's host resolution, without a Slurm cluster (the
integration tests run the script on a real one: tests/integration/test_slurm.py)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from rollart.errors import ConfigError
from rollart.launch import slurm, slurm_hosts
from rollart.launch.local import after_failure
from rollart.topology import RestartPolicy, parse_topology

TOPOLOGY = """
run: {name: demo, insecure: true, trainer: {backend: fsdp2, ranks: 4}}
nodes:
  - {name: trainer, role: trainer, port: 7001, admin_port: 8001, resources: {cpus: 8, gpus: 4, memory_gb: 64}}
  - {name: gen-a, role: generator, hardware: compute, port: 7002, admin_port: 8002, resources: {gpus: 1}}
  - {name: gen-b, role: generator, hardware: bandwidth, port: 7003, admin_port: 8003, resources: {gpus: 1}}
  - {name: env-0, role: env-host, port: 7004, admin_port: 8004, resources: {cpus: 2.5}}
  - {name: env-1, role: env-host, port: 7005, admin_port: 8005}
  - {name: reward, role: reward-gateway, port: 7006, admin_port: 8006}
"""


def test_one_component_per_role_group_with_its_resources_and_partition() -> None:
    topology = parse_topology(TOPOLOGY)
    script = slurm.sbatch_script(
        topology, Path("/shared/demo.yaml"), partitions={"trainer": "h800", "generator": "h20"}, time_limit="2:00:00"
    )
    components = script.split("#SBATCH hetjob")
    assert len(components) == 4
    trainer, generators, env_hosts, reward = components
    assert "--ntasks=1 --cpus-per-task=8" in trainer and "--gpus-per-task=4" in trainer
    assert "--mem-per-cpu=8192M" in trainer and "--partition=h800" in trainer and "--time=2:00:00" in trainer
    assert "--ntasks=2 --cpus-per-task=1" in generators and "--partition=h20" in generators
    assert "--ntasks=2 --cpus-per-task=3" in env_hosts and "--gpus" not in env_hosts  # 2.5 CPUs rounds up
    assert "--ntasks=1" in reward and "--partition" not in reward
    assert "slurm-run --topology /shared/demo.yaml <<'TABLE'" in script
    table = script.split("<<'TABLE'\n", 1)[1].split("\nTABLE", 1)[0]
    assert slurm.read_table(table) == slurm.placements(topology)
    assert [(p.name, p.group) for p in slurm.read_table(table)] == [
        ("trainer", 0),
        ("gen-a", 1),
        ("gen-b", 1),
        ("env-0", 2),
        ("env-1", 2),
        ("reward", 3),
    ]


def test_an_unknown_role_in_a_partition_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown role \['learner'\]"):
        slurm.sbatch_script(parse_topology(TOPOLOGY), Path("t.yaml"), partitions={"learner": "x"})


def test_tasks_per_node_expands_as_slurm_writes_it() -> None:
    assert slurm_hosts.expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert slurm_hosts.expand_counts("4") == [4]


def test_nodes_are_laid_over_each_components_hosts_as_slurm_placed_the_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    lists = {"a[1-2]": ["a1", "a2"], "b1": ["b1"], "c[1-2]": ["c1", "c2"], "d1": ["d1"]}
    monkeypatch.setattr(slurm_hosts, "hostnames", lambda nodelist: lists[nodelist])
    table = slurm.placements(parse_topology(TOPOLOGY))
    env = {
        "SLURM_JOB_NODELIST_HET_GROUP_0": "b1",
        "SLURM_TASKS_PER_NODE_HET_GROUP_0": "1",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "a[1-2]",
        "SLURM_TASKS_PER_NODE_HET_GROUP_1": "1(x2)",
        "SLURM_JOB_NODELIST_HET_GROUP_2": "c[1-2]",
        "SLURM_TASKS_PER_NODE_HET_GROUP_2": "2,0",
        "SLURM_JOB_NODELIST_HET_GROUP_3": "d1",
        "SLURM_TASKS_PER_NODE_HET_GROUP_3": "1",
    }
    hosts = slurm_hosts.resolve_hosts(table, env)
    assert hosts == {"trainer": "b1", "gen-a": "a1", "gen-b": "a2", "env-0": "c1", "env-1": "c1", "reward": "d1"}
    del env["SLURM_TASKS_PER_NODE_HET_GROUP_3"]
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE_HET_GROUP_3 is not set"):
        slurm_hosts.resolve_hosts(table, env)


def test_the_resolved_topology_sits_beside_the_original_with_the_allocations_hosts(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(TOPOLOGY)
    names = [n.name for n in parse_topology(TOPOLOGY).nodes]
    resolved, moves = slurm_hosts.write_resolved(path, {name: f"10.0.0.{i}" for i, name in enumerate(names)}, "42")
    assert resolved == tmp_path / ".demo.slurm-42.yaml" and moves == []
    assert [n.host for n in parse_topology(resolved.read_text()).nodes] == [f"10.0.0.{i}" for i in range(6)]


def test_nodes_placed_on_one_host_with_one_port_get_the_next_free_one(tmp_path: Path) -> None:
    # A cluster topology may give every generator port 7100 (they usually land on different hosts).
    path = tmp_path / "demo.yaml"
    path.write_text(TOPOLOGY.replace("port: 7002,", "port: 7100,").replace("port: 7003,", "port: 7100,"))
    hosts = {"trainer": "10.0.0.1", "gen-a": "10.0.0.2", "gen-b": "10.0.0.2", "env-0": "10.0.0.3"}
    hosts |= {"env-1": "10.0.0.3", "reward": "10.0.0.3"}
    resolved, moves = slurm_hosts.write_resolved(path, hosts, "43")
    ports = {n.name: (n.port, n.admin_port) for n in parse_topology(resolved.read_text()).nodes}
    assert ports["gen-a"] == (7100, 8002) and ports["gen-b"] == (7101, 8003)
    assert moves == ["gen-b: port 7100 -> 7101 (taken on 10.0.0.2)"]


def test_restart_policy_verdicts_shared_by_the_launcher_and_the_job() -> None:
    restarts: collections.deque[float] = collections.deque()
    policy = RestartPolicy(max_restarts=2, window_s=10, backoff_base_s=1, backoff_cap_s=1.5)
    first = after_failure(policy, restarts, now=100.0)
    assert (first.action, first.delay) == ("restart", 1.0)
    restarts.append(100.0)
    assert after_failure(policy, restarts, now=101.0).delay == 1.5  # doubled, capped
    restarts.append(101.0)
    assert after_failure(policy, restarts, now=102.0).action == "stop-all"  # 2 restarts within 10 s
    assert after_failure(policy, restarts, now=111.0).action == "restart"  # the first left the window
    assert after_failure(RestartPolicy(policy="stop-all"), collections.deque(), 0.0).action == "stop-all"
    assert after_failure(RestartPolicy(policy="never"), collections.deque(), 0.0).action == "leave"


GROUP = """
run: {name: demo, insecure: true, trainer: {backend: fsdp2, ranks: 4}}
nodes:
  - {name: trainer, role: trainer, port: 7001, admin_port: 8001, rendezvous_port: 7500, resources: {gpus: 4}}
  - {name: gen-a, role: generator, port: 7002, admin_port: 8002, resources: {gpus: 1}}
  - {name: trainer-b, role: trainer, primary: trainer, port: 7003, admin_port: 8003, resources: {gpus: 4}}
"""


def test_trainer_group_is_one_component_and_only_its_primary_ends_the_job(tmp_path: Path) -> None:
    topology = parse_topology(GROUP)
    script = slurm.sbatch_script(topology, Path("/shared/demo.yaml"))
    trainers, _ = script.split("#SBATCH hetjob")
    assert "component 0: trainer (2 nodes of one trainer group)" in trainers
    assert "--ntasks=2 --cpus-per-task=1" in trainers and "--gpus-per-task=4" in trainers
    assert [(p.name, p.group) for p in slurm.placements(topology)] == [("trainer", 0), ("trainer-b", 0), ("gen-a", 1)]
    steps = [slurm.Step(topology.node(p.name), p, "h1") for p in slurm.placements(topology)]
    supervisor = slurm.Supervisor(topology, tmp_path / "resolved.yaml", steps, groups=2)
    ends = {step.spec.name: "--exit-when-done" in supervisor.command(step) for step in steps}
    assert ends == {"trainer": True, "trainer-b": False, "gen-a": False}


def test_trainer_group_rendezvous_port_moves_like_the_others_on_a_shared_host(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    lines = GROUP.strip().splitlines()
    generator_first = [*lines[:2], lines[3], lines[2], lines[4]]
    path.write_text("\n".join(generator_first).replace("admin_port: 8002", "admin_port: 7500"))
    hosts = dict.fromkeys(("trainer", "gen-a", "trainer-b"), "10.0.0.1")
    resolved, moves = slurm_hosts.write_resolved(path, hosts, "7")
    assert moves == ["trainer: rendezvous_port 7500 -> 7501 (taken on 10.0.0.1)"]
    layout = parse_topology(resolved.read_text()).rank_layout("trainer-b")
    assert (layout.store_host, layout.store_port, layout.first_rank, layout.world_size) == ("10.0.0.1", 7501, 4, 8)
