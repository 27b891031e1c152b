"""The local launcher's CPU split (`rollart.launch.placement`) and the node side of it (`rollart.cpus`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollart.cpus import ENV, cpu_list, parse_cpu_list
from rollart.errors import ConfigError
from rollart.launch.placement import plan_cpus
from rollart.topology import parse_topology

NODES = """
nodes:
  - {name: trainer, role: trainer, port: 17100, admin_port: 17200%s}
  - {name: gen-a, role: generator, hardware: compute, port: 17101, admin_port: 17201%s}
  - {name: gen-b, role: generator, hardware: bandwidth, port: 17102, admin_port: 17202%s}
  - {name: env-0, role: env-host, port: 17103, admin_port: 17203}
"""


def topology(
    trainer: str = "", gen_a: str = "", gen_b: str = "", *, mode: str = "train", generator: str = "{}"
) -> object:
    run = f"run:\n  generator: {generator}\n  rollout: {{mode: {mode}, tasks: [{{name: t, env: frozen-lake}}]}}\n"
    return parse_topology(run + NODES % (trainer, gen_a, gen_b))


def test_no_cpus_given_splits_the_machine_half_to_the_trainer_half_to_the_generators() -> None:
    two = plan_cpus(topology(), [0, 1])
    assert two.picked and not two.oversubscribed
    assert two.cores == {"trainer": (0,), "gen-a": (1,), "gen-b": (1,)}  # two generators share one core
    assert two.env_for("trainer") == {ENV: "0", "OMP_NUM_THREADS": "1"} and two.env_for("env-0") == {}
    line = two.describe(topology().nodes)  # type: ignore[attr-defined]
    assert line == "cpus (picked for this machine, 2 cores 0-1): trainer 0, gen-a 1, gen-b 1; env-0 on any core"
    sixteen = plan_cpus(topology(), range(16))
    assert sixteen.cores == {"trainer": tuple(range(8)), "gen-a": tuple(range(8, 12)), "gen-b": tuple(range(12, 16))}
    assert sixteen.env_for("gen-b") == {ENV: "12-15", "OMP_NUM_THREADS": "4"}
    rollout_only = plan_cpus(topology(mode="rollout-only"), [0, 1])  # the trainer computes nothing: it floats
    assert rollout_only.cores == {"gen-a": (0,), "gen-b": (1,)}
    one = plan_cpus(topology(), [3])
    assert one.cores == {} and one.describe([]) == "cpus: 1 core(s), no node pinned"


def test_a_generator_gets_a_core_for_each_tensor_parallel_worker_where_the_machine_has_them() -> None:
    two = plan_cpus(topology(generator="{backend: vllm, tensor_parallel_size: 2}"), [0, 1])
    assert two.cores == {"trainer": (0,), "gen-a": (0, 1), "gen-b": (0, 1)}  # overlapping the trainer's, and said
    assert two.oversubscribed
    eight = plan_cpus(topology(generator="{backend: vllm, tensor_parallel_size: 2}"), range(8))
    assert eight.cores == {"trainer": (0, 1, 2, 3), "gen-a": (4, 5), "gen-b": (6, 7)}  # the even split is enough
    assert not eight.oversubscribed


def test_given_cpus_are_laid_out_core_after_core_and_wrap_when_the_machine_is_short() -> None:
    split = plan_cpus(
        topology(", resources: {cpus: 2}", ", resources: {cpus: 0.5}", ", resources: {cpus: 0.5}"), [4, 5, 6]
    )
    assert not split.picked and not split.oversubscribed
    assert split.cores == {"trainer": (4, 5), "gen-a": (6,), "gen-b": (6,)}
    short = plan_cpus(topology(", resources: {cpus: 2}", ", resources: {cpus: 1}"), [0, 1])
    assert short.oversubscribed and short.cores == {"trainer": (0, 1), "gen-a": (0,)}  # gen-b gave none: floats
    assert "more cores asked for than this machine has" in short.describe(topology().nodes)  # type: ignore[attr-defined]


def test_cpu_lists_read_and_write_as_linux_does_and_bad_ones_are_refused() -> None:
    assert cpu_list([6, 0, 1, 2, 3]) == "0-3,6" and parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    for bad in ("", "a", "3-x", "-1"):
        with pytest.raises(ConfigError, match="expected a CPU list"):
            parse_cpu_list(bad)


def test_a_node_process_pins_itself_to_the_cores_it_was_given() -> None:
    core = min(os.sched_getaffinity(0))
    code = "import os; from rollart.cpus import pin_from_env; print(pin_from_env(), sorted(os.sched_getaffinity(0)))"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, ENV: str(core)}, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[0] == f"({core},) [{core}]"
    missing = max(os.sched_getaffinity(0)) + 1000
    code = "from rollart.cpus import pin_from_env; pin_from_env()"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, ENV: str(missing)}, capture_output=True, text=True, check=False
    )
    assert out.returncode != 0 and f"{ENV}='{missing}': cannot run on those cores" in out.stderr


def test_a_process_tree_settles_on_its_cores_threads_and_children_too() -> None:
    """What a vLLM generator does once its engine is up: it started on every core (checked, not pinned)."""
    every = sorted(os.sched_getaffinity(0))
    core = every[0]
    code = f"""
import os, subprocess, sys, threading, time
from rollart.cpus import check_from_env, pin_tree
print(check_from_env(), sorted(os.sched_getaffinity(0)) == {every})
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
time.sleep(0.2)
print(pin_tree(({core},)))
tasks = [(p, t) for p in (os.getpid(), child.pid) for t in os.listdir(f"/proc/{{p}}/task")]
print(all(os.sched_getaffinity(int(t)) == {{{core}}} for _, t in tasks))
child.kill()
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, ENV: str(core)}, capture_output=True, text=True, check=True
    )
    checked, pinned, settled = out.stdout.split("\n")[:3]
    assert checked == f"({core},) True"  # the cores are checked, the process stays on every core
    assert int(pinned) >= 3 and settled == "True"  # its threads and its child's
