"""Helpers for tests that run nodes: topology files, admin HTTP, waiting on processes.

Free ports and the topology builder are rollart/testkit's (benchmarks use them too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rollart.protocol import ClientSession, Identity, SessionConfig, tcp_connector
from rollart.protocol.messages import APP
from rollart.testkit.ports import free_ports
from rollart.testkit.topology import TopologyBuilder

__all__ = [
    "ROOT",
    "free_ports",
    "healthy",
    "http",
    "node_client",
    "node_env",
    "start_node",
    "wait_for",
    "write_topology",
]

ROOT = Path(__file__).resolve().parents[1]


def write_topology(
    folder: Path,
    roles: dict[str, str],
    *,
    restart: str = "on-failure",
    extra_run: str = "",
    hardware: dict[str, str] | None = None,
    fields: dict[str, dict[str, Any]] | None = None,
) -> tuple[Path, dict[str, tuple[int, int]]]:
    """Write a topology with the given {name: role} nodes on free ports; returns its path and ports.

    `extra_run` is keys of the `run:` section as YAML (indented by two spaces), which replace those
    set here; `fields` adds keys to nodes by name (`TopologyBuilder.node`'s: `primary=`,
    `rendezvous=True`)."""
    builder = TopologyBuilder(
        folder / "run",
        name="test",
        drain_timeout_s=5,
        restart={"policy": restart, "backoff_base_s": 0.2},
        session={"heartbeat_interval_s": 0.2, "heartbeat_deadline_s": 2.0},
    ).run_section(extra_run)
    for name, role in roles.items():
        builder.node(name, role, hardware=(hardware or {}).get(name, "cpu"), **(fields or {}).get(name, {}))
    path = builder.write(folder / "topology.yaml")
    return path, {name: (given.port, given.admin_port) for name, given in builder.ports().items()}


def node_env(secret: str = "test-secret", token: str = "test-token") -> dict[str, str]:
    return {**os.environ, "ROLLART_SECRET": secret, "ROLLART_ADMIN_TOKEN": token, "PYTHONUNBUFFERED": "1"}


def start_node(topology: Path, name: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollart.node", "--topology", str(topology), "--node", name],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env or node_env(),
            cwd=ROOT,
        )


def http(method: str, port: int, path: str, token: str | None = None) -> tuple[int, Any]:
    """A request to a node's admin endpoint; returns (status, parsed JSON or text)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            status, body = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read().decode()
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    """Poll `predicate()` until it returns something truthy (processes can't signal us an event)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, urllib.error.URLError):
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def healthy(admin_port: int) -> bool:
    status, body = http("GET", admin_port, "/healthz")
    return status == 200 and body.get("ok") is True


def node_client(port: int, peer: str, *, secret: bytes = b"test-secret") -> ClientSession:
    """A session to a node on loopback, as an env-host would open it (the secret node_env gives)."""
    cfg = SessionConfig()
    return ClientSession(
        lambda: tcp_connector("127.0.0.1", port, cfg),
        secret=secret,
        local=Identity("env-0", "env-host"),
        channel=APP,
        cfg=cfg,
        peer_name=peer,
    )
