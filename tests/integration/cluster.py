"""A small training topology's node processes, started by a test and watched through their admin
`/status` and the run folder (shared by the training and admin-CLI tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from rollart.rundir import RunDir, read_jsonl
from tests.support import healthy, http, start_node, wait_for, write_topology

NODES = {
    "trainer": "trainer",
    "gen-compute": "generator",
    "gen-bandwidth": "generator",
    "env-0": "env-host",
    "reward": "reward-gateway",
}
HARDWARE = {"gen-compute": "compute", "gen-bandwidth": "bandwidth"}
GENERATORS = ("gen-compute", "gen-bandwidth")
SECRET = b"test-secret"  # what tests.support.node_env gives every node

LAKE = (
    "{name: lake, env: frozen-lake, env_kwargs: {actions: letters, compact: true, corners: true},"
    " profile: prefill-heavy, max_turns: 4, max_tokens_per_turn: 1}"
)
COPY = (  # partial credit (the env's position match): its groups nearly always have signal to train on
    "{name: copy, env: copy-reverse, env_kwargs: {mode: copy, min_len: 4, max_len: 6, alphabet: ab},"
    " profile: decode-heavy, max_tokens_per_turn: 12}"
)


def training_yaml(
    model: Path,
    *,
    steps: int,
    schedule: str = "async",
    alpha: int = 1,
    checkpoint_every: int = 0,
    batch_groups: int = 2,
    redundancy: int = 0,
    generate_timeout_s: float = 30,
    trainer: str = "",
    transport: str = "tcp",
) -> str:
    """The `run:` keys of a small training run (appended by `write_topology`); `trainer` adds keys
    to `run.trainer` (`backend: fsdp2, ranks: 2`). Weights go star-wise, the trainer connected to
    each generator, which these tests' checks of its connections read (relay: test_weight_transfer,
    test_drain_after_restart and the default run)."""
    return f"""  model: {{path: {model}}}
  generator: {{backend: hf}}
  reward_pool: {{min_workers: 0, max_workers: 1, idle_timeout_s: 30}}
  trainer: {{lr: 0.002, micro_batch_size: 16, checkpoint_every: {checkpoint_every}, threads: 1,
             weights: {{transport: {transport}, fanout: star}}{", " + trainer if trainer else ""}}}
  rollout:
    mode: train
    schedule: {schedule}
    tasks:
      - {LAKE}
      - {COPY}
    group_size: 2
    redundancy: {redundancy}
    batch_groups: {batch_groups}
    alpha: {alpha}
    steps: {steps}
    groups_per_env_host: 2
    generate_timeout_s: {generate_timeout_s}
"""


class Cluster:
    """The node processes of one topology, started by a test; whatever is left is stopped at teardown."""

    def __init__(self, folder: Path, topology: Path, ports: dict[str, tuple[int, int]]) -> None:
        self.folder, self.topology, self.ports = folder, topology, ports
        self.run_dir = folder / "run"
        self.logs = folder / "logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.log_files: dict[str, Path] = {}

    def start(self, *names: str, log_as: str | None = None) -> None:
        """Start these nodes (all by default), each logging to `logs/NAME.log` (or `logs/LOG_AS.log`)."""
        for name in names or tuple(self.ports):
            self.log_files[name] = self.logs / f"{log_as or name}.log"
            self.procs[name] = start_node(self.topology, name, self.log_files[name])

    def wait_healthy(self, *names: str, timeout: float = 90) -> None:
        for name in names or tuple(self.procs):
            wait_for(lambda n=name: self._alive(n) and healthy(self.ports[n][1]), timeout, f"{name} healthy")

    def _alive(self, name: str) -> bool:
        code = self.procs[name].poll()
        if code is not None:
            raise AssertionError(f"node {name} exited with {code}:\n{self.log_tail(name)}")
        return True

    def status(self, name: str) -> dict[str, Any]:
        self._alive(name)
        code, body = http("GET", self.ports[name][1], "/status")
        assert code == 200, body
        return body  # type: ignore[no-any-return]

    def wait_status(self, name: str, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        """Poll `name`'s /status until `predicate(status)` holds; returns that status."""

        def check() -> dict[str, Any] | None:
            status = self.status(name)
            return status if predicate(status) else None

        return wait_for(check, timeout, what)  # type: ignore[no-any-return]

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.kill(self.procs[name].pid, sig)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every node still running (a drain), then SIGKILL what has not exited; exit codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot drain
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                codes[name] = None
        return codes

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.log_files[name]
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    def events(self, name: str, *events: str) -> list[dict[str, Any]]:
        """The node's log records of these events (its latest process's), in the order it logged them."""
        records = []
        for line in self.log_files[name].read_text(errors="replace").splitlines():
            # A progress bar that transformers draws without a newline can come first on a line.
            if (start := line.find('{"')) >= 0:
                records.append(json.loads(line[start:]))
        return [r for r in records if r.get("event") in events]

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(RunDir(self.run_dir).metrics)

    def timeline(self) -> list[dict[str, Any]]:
        return read_jsonl(RunDir(self.run_dir).timeline)


def make_cluster(
    clusters: list[Cluster],
    folder: Path,
    run_yaml: str,
    nodes: dict[str, str] = NODES,
    fields: dict[str, dict[str, Any]] | None = None,
) -> Cluster:
    """`nodes` ({name: role}) on free ports, with `fields` added to nodes by name (`write_topology`)."""
    topology, ports = write_topology(folder, nodes, hardware=HARDWARE, extra_run=run_yaml, fields=fields)
    cluster = Cluster(folder, topology, ports)
    clusters.append(cluster)
    return cluster
