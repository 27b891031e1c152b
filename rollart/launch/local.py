"""The local launcher: `rollart run TOPOLOGY` starts every node of a topology on this machine.

Each node is its own process (`python -m rollart.node`), logging JSON lines to
`RUN_DIR/logs/NODE.log`. The launcher waits until every node answers `/healthz`, shows one live
status line per node, and applies each node's restart policy when its process dies:
`on-failure` restarts it with exponential backoff (like systemd's `Restart=on-failure`, up to
`max_restarts` within `window_s`), `stop-all` stops the run and exits non-zero naming the node,
`never` leaves it dead. Ctrl-C (or `--duration` running out) drains every node with SIGTERM
and waits for them to exit; a node still running after its drain timeout is killed.

When the topology provides no shared secret or admin token, the launcher makes fresh ones for
this run and passes them to the nodes in their environment; the admin token is also written to
`RUN_DIR/admin.token` (mode 0600) for the admin tools.

This module only supervises; what the run shows on the terminal is drawn by `Terminal`
(rollart/launch/terminal.py), fed the nodes' states.

One piece: the `Launcher` starts, watches, restarts and drains the same node processes from one loop,
and each of those steps reads the state the others leave.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import aiohttp

from rollart.errors import ConfigError
from rollart.launch.gpus import place_gpus
from rollart.launch.placement import plan_cpus
from rollart.launch.terminal import Terminal, describe_end, describe_exit
from rollart.node import LAUNCHER_PID_ENV, read_config_error
from rollart.rundir import RunDir
from rollart.topology import NodeSpec, RestartPolicy, Topology
from rollart.topology.exposure import admin_client

EXIT_OK, EXIT_NODE_FAILED, EXIT_CONFIG = 0, 1, 2
POLL_S = 0.5


@dataclass
class NodeProcess:
    """A node as the launcher sees it."""

    spec: NodeSpec
    policy: RestartPolicy
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    log_offset: int = 0
    """Where the log ended when the process started: what it writes comes after."""
    state: str = "starting"
    exit_code: int | None = None
    restarts: collections.deque[float] = field(default_factory=collections.deque)
    status: dict[str, Any] | None = None


def kill_group(pid: int) -> None:
    """SIGKILL the process group a node leads (it is started in its own session): the node, if
    still there, and every process it started that has not left the group, such as vLLM's engine
    core and workers, which would otherwise outlive a killed generator holding gigabytes."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def check_ports_free(topology: Topology) -> None:
    """Fail early, with the node and key named, when a port of the topology is already taken."""
    for index, node in enumerate(topology.nodes):
        sockets = [("listen_port" if node.listen_port else "port", node.host, node.bind_port)]
        sockets.append(("admin_port", node.admin_host, node.admin_port))
        if node.rendezvous_port is not None:  # a trainer group's primary serves its ranks' store there
            sockets.append(("rendezvous_port", node.host, node.rendezvous_port))
        for key, host, port in sockets:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the nodes bind
                try:
                    sock.bind((host, port))
                except OSError as exc:
                    raise ConfigError(
                        f"{topology.source}: nodes[{index}].{key}: port {port} on {host} is not free "
                        f"({exc.strerror}); is another run still going?"
                    ) from None


@dataclass
class Verdict:
    """What a node's restart policy says after its process failed (ended non-zero)."""

    action: Literal["restart", "stop-all", "leave"]
    why: str
    delay: float = 0.0


def after_failure(policy: RestartPolicy, restarts: collections.deque[float], now: float) -> Verdict:
    """Apply `policy` to a failed node whose earlier restarts happened at `restarts` (monotonic
    times, pruned here to the policy's window); the caller appends the restart's time when it
    restarts. Shared by the local launcher and the Slurm job's supervisor (rollart/launch/slurm.py)."""
    if policy.policy == "stop-all":
        return Verdict("stop-all", "restart policy stop-all: stopping the run")
    if policy.policy == "never":
        return Verdict("leave", "restart policy never: leaving it down")
    while restarts and now - restarts[0] > policy.window_s:
        restarts.popleft()
    if len(restarts) >= policy.max_restarts:
        return Verdict("stop-all", f"already restarted {len(restarts)} times within {policy.window_s:g} s")
    delay = min(policy.backoff_cap_s, policy.backoff_base_s * 2 ** len(restarts))
    return Verdict("restart", f"restarting it in {delay:.1f} s (restart policy on-failure)", delay)


def finished_step(topology: Topology) -> int | None:
    """The step of the run directory's latest checkpoint when it is the run's last step, else None.

    A trainer resumes from its latest checkpoint (docs/training.md); once that checkpoint is the
    final step there is nothing left to resume, and a new `rollart run` starts a fresh run instead
    of ending at once."""
    rollout = topology.run.rollout
    if rollout is None or rollout.mode != "train" or rollout.steps is None:
        return None
    step = RunDir(topology.run_dir()).latest_step()
    return step if step is not None and step >= rollout.steps else None


class Launcher:
    """Runs one topology's nodes as local processes until stopped."""

    def __init__(
        self,
        topology: Topology,
        topology_path: str,
        *,
        duration: float | None = None,
        start_timeout: float = 120.0,
        out: TextIO = sys.stdout,
    ) -> None:
        self.topology = topology
        self.topology_path = topology_path
        self.duration = duration
        self.start_timeout = start_timeout
        self.terminal = Terminal(out, topology.run.name)
        self.say = self.terminal.say
        self.run_dir = topology.run_dir()
        self.nodes = [
            NodeProcess(spec, topology.restart_policy(spec), RunDir(self.run_dir).node_log(spec.name))
            for spec in topology.nodes
        ]
        self.env = dict(os.environ)
        self.cpus = plan_cpus(topology, sorted(os.sched_getaffinity(0)))
        self.gpus = place_gpus(topology)
        self._admin_scheme = "http"
        self.stop_reason: str | None = None
        self.failure: str | None = None
        self._stop = asyncio.Event()
        self._healthy = asyncio.Event()
        self._started_at = time.monotonic()

    # -- set-up ---------------------------------------------------------------------------------

    def _prepare(self) -> None:
        run = self.topology.run
        finished = finished_step(self.topology)
        if finished is not None:
            aside = self.run_dir.with_name(f"{self.run_dir.name}.prev-{int(time.time())}")
            self.run_dir.rename(aside)
            self.say(f"{self.run_dir} holds a finished run (checkpoint at step {finished}); moved it to {aside}")
        elif run.rollout is not None and (step := RunDir(self.run_dir).latest_step()) is not None:
            self.say(
                f"{self.run_dir} holds a checkpoint at step {step}: the trainer resumes from it "
                f"(move {self.run_dir} away to start afresh)"
            )
        RunDir(self.run_dir).logs.mkdir(parents=True, exist_ok=True)
        model = Path(run.model.path)
        if run.rollout is not None and run.model.build_tiny_if_missing and run.model.format_warmup_steps:
            from rollart.tiny.warmup import warmup_outdated

            if (model / "config.json").exists() and (why := warmup_outdated(model)):
                aside = model.with_name(f"{model.name}.outdated-{int(time.time())}")
                model.rename(aside)
                self.say(f"{model}: {why}; moved it to {aside} and building it again")
        if run.rollout is not None and run.model.build_tiny_if_missing and not (model / "config.json").exists():
            self.say(f"building the tiny default model in {model}")
            from rollart.tiny.model import ensure_tiny_model

            ensure_tiny_model(model, seed=run.model.seed, prepare=self._warm_up)
        if run.secret_file is None and not os.environ.get(run.secret_env):
            self.env[run.secret_env] = secrets.token_hex(32)
        if run.admin_token_file is None and not os.environ.get(run.admin_token_env):
            self.env[run.admin_token_env] = secrets.token_urlsafe(24)
        with contextlib.suppress(ConfigError):  # a token from a file stays in that file
            token = self.env.get(run.admin_token_env) or self.topology.read_admin_token()
            token_path = RunDir(self.run_dir).admin_token
            token_path.touch(mode=0o600)
            token_path.write_text(token + "\n")
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env[LAUNCHER_PID_ENV] = str(os.getpid())  # a node outlives no launcher (`rollart.node`)
        self.say(self.cpus.describe(self.topology.nodes))
        if gpu_line := self.gpus.describe():
            self.say(gpu_line)

    def _warm_up(self, folder: Path) -> None:
        run = self.topology.run
        steps = run.model.format_warmup_steps
        if steps == 0 or run.rollout is None:
            return
        from rollart.tiny.warmup import format_warmup

        self.say(
            f"format warm-up: {steps} supervised steps on random valid moves "
            "(the reply format and which moves move; no solutions)"
        )
        summary = format_warmup(folder, run.rollout.tasks, steps=steps, seed=run.model.seed)
        self.say(f"format warm-up done in {summary['seconds']} s, final loss {summary['final_loss']}")

    async def _spawn(self, node: NodeProcess) -> None:
        with node.log_path.open("ab") as log_file:
            node.log_offset = log_file.seek(0, os.SEEK_END)
            node.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "rollart.node",
                "--topology",
                self.topology_path,
                "--node",
                node.spec.name,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env=self.env | self.cpus.env_for(node.spec.name) | self.gpus.env_for(node.spec.name),
                start_new_session=True,  # Ctrl-C reaches the launcher, which drains the nodes
            )
        node.state, node.exit_code, node.status = "starting", None, None

    # -- running --------------------------------------------------------------------------------

    async def run(self) -> int:
        check_ports_free(self.topology)
        self.gpus.check(self.topology)  # a node asking for GPUs this machine lacks: refused before any starts
        self._prepare()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop, f"{signal.Signals(sig).name} received")
        self.say(f"rollart run {self.topology.run.name}: {len(self.nodes)} nodes, logs in {RunDir(self.run_dir).logs}")
        try:
            scheme, context = admin_client(self.topology)
            self._admin_scheme = scheme
            connector = aiohttp.TCPConnector(ssl=context) if context is not None else None
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0), connector=connector) as http:
                for node in self.nodes:
                    await self._spawn(node)
                async with asyncio.TaskGroup() as tg:
                    supervisors = [tg.create_task(self._supervise(node)) for node in self.nodes]
                    poller = tg.create_task(self._poll(http))
                    watcher = tg.create_task(self._watch_start())
                    timer = tg.create_task(self._stop_after(self.duration)) if self.duration is not None else None
                    await self._stop.wait()
                    await self._shutdown()
                    poller.cancel()
                    watcher.cancel()
                    if timer is not None:  # stopped before --duration ran out: exit now, not when it does
                        timer.cancel()
                    await asyncio.gather(*supervisors)
                    self.terminal.render(self.nodes, final=True)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        return self._summary()

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self._stop.set()

    def fail(self, reason: str) -> None:
        self.failure = self.failure or reason
        self.say(f"error: {reason}")
        self.stop(reason)

    async def _watch_start(self) -> None:
        """Say when every node is up; stop the run if they are not within `start_timeout`."""
        try:
            await asyncio.wait_for(self._healthy.wait(), self.start_timeout)
        except TimeoutError:
            late = [n.spec.name for n in self.nodes if n.state not in ("running", "paused")]
            self.fail(f"nodes {', '.join(late)} not healthy {self.start_timeout:g} s after start; see their logs")
            return
        self.say(f"all {len(self.nodes)} nodes healthy after {time.monotonic() - self._started_at:.1f} s")

    async def _stop_after(self, seconds: float) -> None:
        await self._healthy.wait()
        await asyncio.sleep(seconds)
        self.stop(f"--duration {seconds:g} s elapsed")

    async def _supervise(self, node: NodeProcess) -> None:
        """Wait for the node's process to end and apply its restart policy."""
        while True:
            assert node.proc is not None
            code = await node.proc.wait()
            node.exit_code = code
            kill_group(node.proc.pid)  # what it started (vLLM's engine processes) goes with it
            if self._stop.is_set():
                node.state = "stopped" if code == 0 else f"stopped ({describe_exit(code)})"
                return
            what = describe_end(node.spec.name, code, node.log_path, node.log_offset)
            if code == 0:
                node.state = "exited"
                self.say(f"{what}: it drained on request and is not restarted")
                return
            if code == EXIT_CONFIG:
                node.state = "failed"
                why = f"{what}: a configuration error, which a restart would not fix"
                message = read_config_error(node.log_path, node.log_offset)
                self.fail(f"{why}: {message}" if message else why)
                return
            verdict = after_failure(node.policy, node.restarts, time.monotonic())
            if verdict.action == "stop-all":
                node.state = "failed"
                self.fail(f"{what}; {verdict.why}")
                return
            if verdict.action == "leave":
                node.state = "dead"
                self.say(f"{what}; {verdict.why}")
                return
            delay = verdict.delay
            node.state = f"restarting in {delay:.1f}s"
            self.say(f"{what}; {verdict.why}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            if self._stop.is_set():
                node.state = "stopped"
                return
            node.restarts.append(time.monotonic())
            await self._spawn(node)

    async def _shutdown(self) -> None:
        self.say(f"stopping: {self.stop_reason}; draining every node")
        running = [n for n in self.nodes if n.proc is not None and n.proc.returncode is None]
        for node in running:
            assert node.proc is not None
            node.state = "draining"
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGTERM)
        grace = self.topology.run.drain_timeout_s + 10.0
        waits = [asyncio.ensure_future(n.proc.wait()) for n in running if n.proc is not None]
        if waits:
            await asyncio.wait(waits, timeout=grace)
        for node in running:
            assert node.proc is not None
            if node.proc.returncode is None:
                self.say(f"node {node.spec.name} did not exit within {grace:g} s of SIGTERM: killing it")
                kill_group(node.proc.pid)
                await node.proc.wait()

    # -- status -------------------------------------------------------------------------------

    async def _poll(self, http: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.gather(*(self._poll_node(http, node) for node in self.nodes))
            if all(node.state in ("running", "paused") for node in self.nodes):
                self._healthy.set()
            finished = [n.spec.name for n in self.nodes if n.status and n.status.get("done")]
            if finished:
                self.stop(f"{', '.join(finished)} finished the run")
            self.terminal.render(self.nodes)
            await asyncio.sleep(POLL_S)

    async def _poll_node(self, http: aiohttp.ClientSession, node: NodeProcess) -> None:
        if node.proc is None or node.proc.returncode is not None:
            return
        url = f"{self._admin_scheme}://{_connectable(node.spec.admin_host)}:{node.spec.admin_port}/status"
        try:
            async with http.get(url) as response:
                node.status = await response.json()
        except (aiohttp.ClientError, TimeoutError):
            node.status = None
            return
        if node.state == "starting" or node.state in ("running", "paused"):
            node.state = node.status["state"] if node.status else node.state

    def _report(self) -> None:
        if not RunDir(self.run_dir).metrics.exists():
            return
        from rollart.report import ReportError, build_report

        try:
            out = build_report(self.run_dir)
        except (ReportError, OSError, ValueError) as exc:
            self.say(f"could not build the run report: {exc}")
            return
        self.say(f"run report: {out / 'report.md'} (plots beside it)")

    def _summary(self) -> int:
        self._report()
        unclean = [n for n in self.nodes if n.exit_code not in (0, None)]
        self.terminal.summary(self.failure, unclean, len(self.nodes))
        return EXIT_NODE_FAILED if self.failure or unclean else EXIT_OK


def _connectable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
