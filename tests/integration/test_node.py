"""A node as an operator meets it: started from a shell, probed over admin HTTP, stopped by a signal."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT, healthy, http, node_env, start_node, wait_for, write_topology

pytestmark = pytest.mark.integration


def test_rollart_node_from_a_shell_answers_healthz_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    topology, ports = write_topology(tmp_path, {"gen-0": "generator"})
    with (tmp_path / "node.log").open("wb") as log:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec bin/rollart-node --topology {topology} --node gen-0"],
            cwd=ROOT,
            env=node_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: healthy(ports["gen-0"][1]), 60, "gen-0 /healthz")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    lines = (tmp_path / "node.log").read_text().splitlines()
    assert any('"event": "node.stopped"' in line and '"node": "gen-0"' in line for line in lines)


def test_admin_mutations_need_the_token_and_drain_exits_cleanly(tmp_path: Path) -> None:
    topology, ports = write_topology(tmp_path, {"trainer": "trainer", "gen-0": "generator", "env-0": "env-host"})
    procs = {name: start_node(topology, name, tmp_path / f"{name}.log") for name in ports}
    try:
        for name, (_, admin) in ports.items():
            wait_for(lambda admin=admin: healthy(admin), 30, f"{name} /healthz")
        gen_admin = ports["gen-0"][1]
        for path in ("/pause", "/resume", "/drain"):
            assert http("POST", gen_admin, path)[0] == 401
            assert http("POST", gen_admin, path, token="wrong")[0] == 401
        assert http("GET", gen_admin, "/status")[1]["paused"] is False

        status, body = http("POST", gen_admin, "/pause", token="test-token")
        assert (status, body["state"]) == (200, "paused")
        assert http("GET", gen_admin, "/status")[1]["paused"] is True
        status, body = http("POST", gen_admin, "/resume", token="test-token")
        assert (status, body["state"]) == (200, "running")

        # The env-host opens sessions to the trainer and the generator; its status shows them up.
        def env_sessions_up() -> bool:
            sessions = http("GET", ports["env-0"][1], "/status")[1]["sessions"]["outgoing"]
            return sorted(s["peer"] for s in sessions if s["state"] == "up") == ["gen-0", "trainer"]

        wait_for(env_sessions_up, 20, "env-0's sessions to trainer and gen-0")

        def gen_sessions_up() -> bool:
            sessions = http("GET", gen_admin, "/status")[1]["sessions"]["incoming"]
            return sorted(s["peer"] for s in sessions if s["state"] == "up") == ["env-0", "trainer"]

        wait_for(gen_sessions_up, 20, "gen-0's sessions from trainer and env-0")

        _, text = http("GET", gen_admin, "/metrics")
        families = {family.name: family for family in text_string_to_metric_families(text)}
        assert families["rollart_node_paused"].samples[0].value == 0.0
        up = {(s.labels["peer"], s.labels["direction"]): s.value for s in families["rollart_session_up"].samples}
        assert up == {("trainer", "in"): 1.0, ("env-0", "in"): 1.0}
        assert "process_resident_memory_bytes" in families

        status, body = http("POST", gen_admin, "/drain", token="test-token")
        assert status == 200
        assert procs["gen-0"].wait(timeout=20) == 0
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                assert proc.wait(timeout=20) == 0
            finally:
                proc.kill()


def test_bad_topology_exits_2_naming_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - {name: g, role: gen, port: 1, admin_port: 2}\n")
    result = subprocess.run(  # noqa: PLW1510 - the exit code is what is checked
        ["bin/rollart-node", "--topology", str(bad), "--node", "g"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "nodes[0].role: expected one of trainer, generator, env-host, reward-gateway; got 'gen'" in result.stderr


def test_missing_secret_exits_2_saying_how_to_give_one(tmp_path: Path) -> None:
    topology, _ = write_topology(tmp_path, {"gen-0": "generator"})
    env = {k: v for k, v in node_env().items() if k != "ROLLART_SECRET"}
    result = subprocess.run(  # noqa: PLW1510 - the exit code is what is checked
        ["bin/rollart-node", "--topology", str(topology), "--node", "gen-0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "ROLLART_SECRET" in result.stderr and "secret_file" in result.stderr
