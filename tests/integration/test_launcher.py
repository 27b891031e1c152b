"""`rollart run`: every node as its own process, health, live status, restart policies, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.launch.placement import plan_cpus
from rollart.rundir import RunDir
from rollart.topology import load_topology
from tests.support import ROOT, healthy, http, node_env, wait_for, write_topology

pytestmark = pytest.mark.integration

ROLES = {"trainer": "trainer", "gen-0": "generator", "env-0": "env-host", "reward": "reward-gateway"}


def launch(topology: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`rollart run` in the background as a user starts it (no secret or token set), `env` added."""
    env = {k: v for k, v in node_env().items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")} | (env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "rollart.cli", "run", str(topology), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_to_end(topology: Path, timeout: float = 60) -> tuple[int, str]:
    """`rollart run` until it exits by itself: its exit code and its output (killed if it outlives `timeout`)."""
    proc = launch(topology)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out


def pid_of(admin_port: int) -> int:
    return int(http("GET", admin_port, "/status")[1]["pid"])


def test_run_starts_every_node_and_stops_cleanly_after_duration(tmp_path: Path) -> None:
    topology, _ = write_topology(tmp_path, ROLES)
    proc = launch(topology, "--duration", "1")
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    assert "all 4 nodes healthy" in out
    assert "all 4 nodes stopped cleanly" in out
    for name in ROLES:
        log = RunDir(tmp_path / "run").node_log(name).read_text()
        assert '"event": "node.started"' in log and '"event": "node.stopped"' in log
    token = RunDir(tmp_path / "run").admin_token
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) > 20


def test_on_failure_restarts_a_killed_node_and_ctrl_c_drains_the_run(tmp_path: Path) -> None:
    topology, ports = write_topology(tmp_path, ROLES, restart="on-failure")
    proc = launch(topology)
    try:
        for name, (_, admin) in ports.items():
            wait_for(lambda admin=admin: healthy(admin), 60, f"{name} healthy")
        # every node runs on its share of this machine's cores (all of them: env-host, reward)
        split = plan_cpus(load_topology(topology), sorted(os.sched_getaffinity(0)))
        every = os.sched_getaffinity(0)
        for name, (_, admin) in ports.items():
            assert os.sched_getaffinity(pid_of(admin)) == set(split.cores.get(name, every)), name
        gen_admin = ports["gen-0"][1]
        first = pid_of(gen_admin)
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: pid_of(gen_admin) != first and pid_of(gen_admin), 30, "gen-0 restarted")
        assert second != first
        assert os.sched_getaffinity(second) == set(split.cores.get("gen-0", every))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "node gen-0 was killed by SIGKILL" in out and "restart policy on-failure" in out
    assert "SIGINT received" in out and "all 4 nodes stopped cleanly" in out
    assert split.describe(load_topology(topology).nodes) in out


def test_a_run_stopped_before_its_duration_exits_without_waiting_it_out(tmp_path: Path) -> None:
    topology, ports = write_topology(tmp_path, ROLES)
    proc = launch(topology, "--duration", "600")
    try:
        for name, (_, admin) in ports.items():
            wait_for(lambda admin=admin: healthy(admin), 60, f"{name} healthy")
        proc.send_signal(signal.SIGTERM)  # as a benchmark stops a run that reached its score
        out, _ = proc.communicate(timeout=60)  # not the 600 s of --duration
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "SIGTERM received" in out and "all 4 nodes stopped cleanly" in out


def test_a_killed_launcher_leaves_no_node_running(tmp_path: Path) -> None:
    """SIGKILL gives the launcher no chance to stop its nodes (a test's timeout, the OOM killer): each node
    drains by itself when its launcher dies, and none runs on as an orphan."""
    topology, ports = write_topology(tmp_path, ROLES)
    proc = launch(topology)
    try:
        for name, (_, admin) in ports.items():
            wait_for(lambda admin=admin: healthy(admin), 60, f"{name} healthy")
        pids = {name: pid_of(admin) for name, (_, admin) in ports.items()}
    finally:
        proc.kill()
        proc.communicate(timeout=30)

    def gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() and _not_zombie(pid) for pid in pids.values())

    wait_for(gone, 60, f"every node ({pids}) gone after its launcher was killed")
    for name in ROLES:
        assert '"event": "node.stopped"' in RunDir(tmp_path / "run").node_log(name).read_text(), name


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_stop_all_ends_the_run_with_an_error_naming_the_node(tmp_path: Path) -> None:
    topology, ports = write_topology(tmp_path, ROLES, restart="stop-all")
    proc = launch(topology)
    try:
        for name, (_, admin) in ports.items():
            wait_for(lambda admin=admin: healthy(admin), 60, f"{name} healthy")
        os.kill(pid_of(ports["reward"][1]), signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert "node reward was killed by SIGKILL" in out
    assert "restart policy stop-all: stopping the run" in out


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    import socket

    topology, ports = write_topology(tmp_path, {"gen-0": "generator"})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports["gen-0"][1]))
        busy.listen()
        proc = launch(topology, "--duration", "1")
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"nodes[0].admin_port: port {ports['gen-0'][1]} on 127.0.0.1 is not free" in out


def test_a_node_with_a_configuration_error_stops_the_run_instead_of_restarting(tmp_path: Path) -> None:
    # The reward gateway imports its reward modules when it starts: a module that does not exist
    # fails it the same way every time, so it exits 2 and the launcher stops the run.
    topology, _ = write_topology(tmp_path, {"reward": "reward-gateway"}, extra_run="  reward_modules: [no_such_mod]\n")
    code, out = run_to_end(topology)
    assert code == 1, out
    assert "node reward exited with code 2" in out, out
    assert "a configuration error, which a restart would not fix" in out and "restarting" not in out
    log = RunDir(tmp_path / "run").node_log("reward").read_text()
    assert "run.reward_modules: cannot import module 'no_such_mod'" in log
    assert "run.reward_modules: cannot import module 'no_such_mod'" in out, out  # not only in the log


def test_the_launcher_prints_the_error_of_a_node_that_fails_its_configuration(tmp_path: Path) -> None:
    # An env-host imports the users' env modules when it prepares its tasks: the message is in its
    # log, and the launcher shows it next to the exit status, so the user need not open the log.
    run = (
        "  env_modules: [no_such_env_module]\n"
        "  model: {build_tiny_if_missing: false}\n"
        "  rollout: {tasks: [{name: lake, env: frozen-lake}]}\n"
    )
    topology, _ = write_topology(tmp_path, {"env-0": "env-host"}, extra_run=run)
    log = RunDir(tmp_path / "run").node_log("env-0")
    log.parent.mkdir(parents=True)
    # A message from an earlier run in the same log is not this run's.
    log.write_text("rollart-node: configuration error: an old one\n")
    code, out = run_to_end(topology)
    assert code == 1, out
    failed = next(line for line in out.splitlines() if line.startswith("error: node env-0 exited with code 2"))
    assert "a configuration error, which a restart would not fix: " in failed, out
    assert "run.env_modules: cannot import env module 'no_such_env_module'" in failed, out
    assert "an old one" not in out, out
