"""GPUs in a topology: the load-time rules (`rollart.topology.gpus`), the local launcher's placement and
`CUDA_VISIBLE_DEVICES` (`rollart.launch.gpus`), and a node's own check that it sees its GPUs (`rollart.node`).
None of it needs a GPU: the machine's GPUs are given as the launcher would find them."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from rollart import node as node_main
from rollart.cli import main as cli_main
from rollart.errors import ConfigError
from rollart.launch import local
from rollart.launch.gpus import ENV, HostGpus, host_gpus, place_gpus
from rollart.topology import Topology, parse_topology
from rollart.topology.gpus import plan_gpus

# insecure: the nodes on other hosts are about GPU pools, not networks
RUN = "run:\n  insecure: true\n  trainer: {backend: fsdp2, ranks: 2}\n  generator: {backend: hf}\n"


def _topology(nodes: str, run: str = RUN) -> Topology:
    return parse_topology(run + "nodes:\n" + nodes)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def test_gpu_placement_holds_explicit_ids_and_fills_the_next_free_ones_in_topology_order() -> None:
    topology = _topology(
        """
  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 2}}
  - {name: gen-a, role: generator, port: 7101, admin_port: 7201, resources: {gpus: 1, gpu_ids: [0]}}
  - {name: gen-b, role: generator, port: 7102, admin_port: 7202, resources: {gpus: 1}}
  - {name: env-0, role: env-host, port: 7103, admin_port: 7203}
  - {name: gen-c, role: generator, host: 10.0.0.2, port: 7104, admin_port: 7204, resources: {gpus: 1}}
"""
    )
    # gen-a holds GPU 0 wherever it sits in the file; the others take the lowest free ids in order; another
    # host is another pool (gen-c), and loopback names are one machine.
    assert plan_gpus(topology) == {"trainer": (1, 2), "gen-a": (0,), "gen-b": (3,), "env-0": (), "gen-c": (0,)}
    # the local launcher runs every node here, whatever its host: one pool
    assert plan_gpus(topology, one_host=True)["gen-c"] == (4,)


def test_gpu_placement_shares_a_gpu_only_when_both_nodes_say_so() -> None:
    nodes = """
  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 2, gpu_ids: [0, 1]%s}}
  - {name: gen-a, role: generator, port: 7101, admin_port: 7201, resources: {gpus: 1, gpu_ids: [1]%s}}
"""
    with pytest.raises(ConfigError) as refused:
        _topology(nodes % ("", ", share_gpus: true"))
    assert str(refused.value) == (
        "<string>: nodes[1].resources.gpu_ids: GPU 1 on 127.0.0.1 is already given to trainer (nodes[0]); "
        "two nodes share a GPU only when both set resources.share_gpus: true"
    )
    shared = _topology(nodes % (", share_gpus: true", ", share_gpus: true"))
    assert plan_gpus(shared) == {"trainer": (0, 1), "gen-a": (1,)}
    # on different hosts the same ids are different GPUs
    _topology(nodes.replace("port: 7101", "host: 10.0.0.9, port: 7101") % ("", ""))


def test_gpu_placement_rules_checked_at_load_name_yaml_paths() -> None:
    with pytest.raises(ConfigError) as refused:
        _topology(
            """
  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 4, gpu_type: H10}}
  - {name: gen-a, role: generator, port: 7101, admin_port: 7201, resources: {gpus: 2, gpu_ids: [3]}}
"""
        )
    lines = str(refused.value).splitlines()
    assert lines[0].startswith("<string>: nodes[0].resources.gpu_type: unknown GPU kind 'H10' (known: B200, H200")
    assert lines[0].endswith("did you mean 'H100'?")
    assert lines[1] == (
        "<string>: nodes[0].resources.gpus: trainer trainer has 4 GPU(s) but run.trainer.ranks is 2: one rank per "
        "GPU; set ranks: 4 (backend fsdp2 or megatron) or gpus: 2"
    )
    assert (
        lines[2] == "<string>: nodes[1].resources.gpu_ids: lists 1 GPU(s) but resources.gpus is 2; give one id per GPU"
    )
    assert lines[3] == (
        "<string>: nodes[1].resources.gpus: generator gen-a has 2 GPU(s) but its engines need run.generator.engines x "
        "tensor_parallel_size = 1 x 1 = 1"
    )
    # a kind not in the table is fine with its memory given
    _topology(
        "  - {name: gen, role: generator, port: 7101, admin_port: 7201, resources: {gpus: 1, gpu_type: MI300X, "
        "gpu_memory_gb: 192}}\n"
    )


def test_gpu_placement_sets_cuda_visible_devices_for_every_node() -> None:
    topology = _topology(
        """
  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 2}}
  - {name: gen-a, role: generator, port: 7101, admin_port: 7201, resources: {gpus: 1, gpu_ids: [3]}}
  - {name: env-0, role: env-host, port: 7103, admin_port: 7203}
"""
    )
    placement = place_gpus(topology, HostGpus(("4", "5", "6", "7"), "CUDA_VISIBLE_DEVICES='4,5,6,7'"))
    placement.check(topology)
    # the topology's ids index the launcher's own GPUs: confined to 4-7, GPU 0 is device 4
    assert placement.env_for("trainer") == {ENV: "4,5"}
    assert placement.env_for("gen-a") == {ENV: "7"}
    assert placement.env_for("env-0") == {ENV: ""}  # sees none
    assert placement.describe() == (
        "gpus: 4 GPU(s) (CUDA_VISIBLE_DEVICES='4,5,6,7'): trainer 0-1, gen-a 3; the other nodes see none"
    )


def test_gpu_placement_more_gpus_than_the_host_has_is_refused_with_the_yaml_path() -> None:
    topology = _topology(
        """
  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 2}}
  - {name: gen-a, role: generator, port: 7101, admin_port: 7201, resources: {gpus: 1}}
"""
    )
    place_gpus(topology, HostGpus(("0", "1", "2"), "nvidia-smi -L")).check(topology)  # exactly enough
    with pytest.raises(ConfigError) as refused:
        place_gpus(topology, HostGpus(("0", "1"), "nvidia-smi -L")).check(topology)
    assert str(refused.value) == (
        "<string>: nodes[1].resources.gpus: node gen-a needs GPU(s) 2 of this machine, which has 2 (nvidia-smi -L); "
        "the topology asks for 3 in all: run it where the GPUs are (rollart slurm), or lower resources.gpus"
    )


def test_gpu_placement_rollart_run_refuses_before_any_node_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ports = _free_ports(6)
    path = tmp_path / "gpus.yaml"
    path.write_text(
        # vllm: refused before `rollart run` would set up vLLM's environment (minutes) where it is missing
        f"run:\n  run_dir: {tmp_path}/run\n  trainer: {{backend: fsdp2, ranks: 2}}\n  generator: {{backend: vllm}}\n"
        "  rollout: {tasks: [{name: lake, env: frozen-lake}]}\n"
        "nodes:\n"
        f"  - {{name: trainer, role: trainer, port: {ports[0]}, admin_port: {ports[1]}, resources: {{gpus: 2}}}}\n"
        f"  - {{name: env-0, role: env-host, port: {ports[2]}, admin_port: {ports[3]}}}\n"
        f"  - {{name: gen-0, role: generator, port: {ports[4]}, admin_port: {ports[5]}}}\n"
    )
    monkeypatch.setenv(ENV, "")  # this machine as the launcher sees it: no GPU
    spawned: list[Any] = []
    monkeypatch.setattr(local.Launcher, "_spawn", lambda self, node: spawned.append(node))
    assert cli_main(["run", str(path)]) == 2
    assert spawned == [] and not (tmp_path / "run").exists()
    assert capsys.readouterr().err == (
        f"rollart: {path}: nodes[0].resources.gpus: node trainer needs GPU(s) 0-1 of this machine, which has 0 "
        "(CUDA_VISIBLE_DEVICES=''); the topology asks for 2 in all: run it where the GPUs are (rollart slurm), or "
        "lower resources.gpus\n"
    )


def test_gpu_placement_reaches_each_spawned_nodes_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topology = parse_topology(
        # vllm: refused before `rollart run` would set up vLLM's environment (minutes) where it is missing
        f"run:\n  run_dir: {tmp_path}/run\n  trainer: {{backend: fsdp2, ranks: 2}}\n  generator: {{backend: vllm}}\n"
        "  rollout: {tasks: [{name: lake, env: frozen-lake}]}\n"
        "nodes:\n"
        "  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 2}}\n"
        "  - {name: env-0, role: env-host, port: 7103, admin_port: 7203}\n"
    )
    monkeypatch.setenv(ENV, "2,3")
    launcher = local.Launcher(topology, "gpus.yaml")
    (tmp_path / "run" / "logs").mkdir(parents=True)
    envs: dict[str, dict[str, str]] = {}

    async def fake_exec(*args: str, env: dict[str, str], **kwargs: Any) -> object:
        envs[args[args.index("--node") + 1]] = env
        return object()

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    for node in launcher.nodes:
        asyncio.run(launcher._spawn(node))
    assert envs["trainer"][ENV] == "2,3" and envs["env-0"][ENV] == ""


def test_gpu_placement_reads_the_hosts_gpus_without_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_gpus({ENV: "GPU-a1, GPU-b2"}).devices == ("GPU-a1", "GPU-b2")
    assert host_gpus({ENV: ""}).devices == ()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\necho '  MIG 1g.10gb Device 0: (UUID: MIG-0)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi.parent))
    assert host_gpus({}) == HostGpus(("0", "1"), "nvidia-smi -L")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    proc = tmp_path / "proc"
    (proc / "0000:17:00.0").mkdir(parents=True)
    assert host_gpus({}, proc=proc) == HostGpus(("0",), str(proc))
    assert host_gpus({}, proc=tmp_path / "none").devices == ()


def test_gpu_placement_a_node_seeing_fewer_gpus_than_given_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        RUN + "nodes:\n  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 2}}\n"
    )
    monkeypatch.setenv("ROLLART_SECRET", "s" * 32)
    monkeypatch.setenv(ENV, "")
    monkeypatch.delenv("ROLLART_CPUS", raising=False)
    assert node_main.main(["--topology", str(path), "--node", "trainer"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"{node_main.CONFIG_ERROR_MARK}{path}: nodes[0].resources.gpus: node trainer is given 2 GPU(s) but sees 0 "
        "(CUDA_VISIBLE_DEVICES='', torch "
    )
    assert os.environ[ENV] == ""  # the check only reads


def test_gpu_placement_megatron_ranks_divide_into_tensor_and_pipeline_parallel() -> None:
    run = "run:\n  trainer: {backend: megatron, ranks: 4, tensor_parallel: 2, pipeline_parallel: %d}\n"
    node = "  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 4}}\n"
    assert _topology(node, run % 2).run.trainer.pipeline_parallel == 2
    with pytest.raises(ConfigError) as refused:
        _topology(node, run % 3)
    assert str(refused.value) == (
        "<string>: run.trainer.ranks: the trainer's 4 rank(s) do not divide into tensor_parallel x "
        "pipeline_parallel = 2 x 3 = 6"
    )
