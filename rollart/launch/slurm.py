"""Slurm: `rollart slurm TOPOLOGY` writes an sbatch script; the script's supervisor runs the job.

The script asks for a **heterogeneous job**, one component per role group present (trainers,
generators, env-hosts, the reward gateway), each with its own partition, CPUs, GPUs and memory,
as disaggregated clusters schedule them. A trainer that spans hosts (a primary trainer node and
members that run more of its ranks: `primary:` in the topology) is the trainer component. Its
body hands the script's own table (node name -> component, CPUs, GPUs) to `rollart slurm-run`, the
job's supervisor, which:

1. **resolves hosts and ports** from Slurm's allocation (`rollart/launch/slurm_hosts.py`): each
   component's nodes are laid over the hosts Slurm gave its tasks, and the topology so resolved is
   written beside the original (`.NAME.slurm-JOBID.yaml`), so nodes (and a trainer group's ranks)
   find each other without hand-edited addresses;
2. starts every node as **its own job step** (`srun --het-group=G --nodelist=HOST --ntasks=1
   --exact ... bin/rollart-node`): Slurm never restarts a task, so a step that fails is started
   again by the supervisor under the node's restart policy (on-failure: backoff within the
   window; stop-all: every node is drained and the job fails naming the node; never: left down);
3. ends the job when the trainer (a group's primary) has checkpointed its last step (it runs with
   `--exit-when-done`):
   the other nodes are drained with SIGTERM; and on `scancel` (SIGTERM to the batch step) drains
   every node, restarting none: what the buffer and the last checkpoint hold is kept
   (docs/training.md), and a new job resumes from it.

Each node logs to `RUN_DIR/logs/NODE.log`; the supervisor's own lines go to the job's output.
Slurm's `KillWait` must exceed the topology's `drain_timeout_s` for drains to finish before SIGKILL.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from rollart.errors import ConfigError
from rollart.launch.local import after_failure
from rollart.launch.slurm_hosts import group_env, node_address, resolve_hosts, write_resolved
from rollart.launch.terminal import describe_end
from rollart.node import read_config_error
from rollart.rundir import RunDir
from rollart.topology import NodeSpec, Topology, load_topology
from rollart.topology.roles import Role

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
ROLE_ORDER = (Role.TRAINER, Role.GENERATOR, Role.ENV_HOST, Role.REWARD_GATEWAY)
ROOT = Path(__file__).resolve().parents[2]  # the checkout: rollart/launch/slurm.py -> ../../


@dataclass(frozen=True)
class Placement:
    """Where one node runs: its het-job component, the CPUs and GPUs of its step."""

    name: str
    group: int
    cpus: int
    gpus: int


def components(topology: Topology) -> list[list[NodeSpec]]:
    """The topology's nodes grouped by role, in a fixed role order: one het-job component each."""
    return [nodes for role in ROLE_ORDER if (nodes := topology.nodes_with_role(role))]


def placements(topology: Topology) -> list[Placement]:
    return [
        Placement(node.name, g, max(1, math.ceil(node.resources.cpus or 1)), node.resources.gpus)
        for g, nodes in enumerate(components(topology))
        for node in nodes
    ]


def is_the_trainer(node: NodeSpec) -> bool:
    """Whether `node` is the run's trainer, whose end is the job's (not a member of its group)."""
    return node.role is Role.TRAINER and node.primary is None


def sbatch_script(
    topology: Topology,
    topology_path: Path,
    *,
    partitions: dict[str, str] | None = None,
    time_limit: str | None = None,
    root: Path = ROOT,
) -> str:
    """The sbatch script for `topology` (read from `topology_path` on the cluster's shared disk)."""
    partitions = partitions or {}
    unknown = set(partitions) - {role.value for role in Role}
    if unknown:
        raise ConfigError(f"--partition: unknown role {sorted(unknown)}; roles: {', '.join(r.value for r in Role)}")
    run_dir = (Path.cwd() / topology.run_dir()).resolve()
    lines = [
        "#!/bin/bash",
        f"# RollArt job for {topology_path} (written by `rollart slurm`): one het-job component per role group.",
        f"#SBATCH --job-name=rollart-{topology.run.name}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --chdir={Path.cwd()}",  # where the topology's relative paths (run_dir) were meant from
    ]
    lines += [f"#SBATCH --time={time_limit}"] if time_limit else []
    for g, nodes in enumerate(components(topology)):
        role = nodes[0].role.value
        if g:
            lines.append("#SBATCH hetjob")
        cpus = max(max(1, math.ceil(n.resources.cpus or 1)) for n in nodes)
        group = " of one trainer group" if role == Role.TRAINER.value and len(nodes) > 1 else ""
        lines.append(f"# component {g}: {role} ({len(nodes)} node{'s' * (len(nodes) > 1)}{group})")
        lines.append(f"#SBATCH --ntasks={len(nodes)} --cpus-per-task={cpus}")
        if gpus := max(n.resources.gpus for n in nodes):
            lines.append(f"#SBATCH --gpus-per-task={gpus}")
        memory = [n.resources.memory_gb for n in nodes if n.resources.memory_gb is not None]
        if memory:
            lines.append(f"#SBATCH --mem-per-cpu={math.ceil(max(memory) * 1024 / cpus)}M")
        if role in partitions:
            lines.append(f"#SBATCH --partition={partitions[role]}")
    table = "\n".join(f"{p.name:<24} {p.group:<6} {p.cpus:<5} {p.gpus}" for p in placements(topology))
    lines += [
        "",
        "# The supervisor (rollart/launch/slurm.py) resolves each node's host from the allocation, starts each",
        "# node as its own step, restarts it under its restart policy, and drains all on scancel.",
        "# Node -> component, as this script's own table:",
        f"exec {shlex.quote(str(root / 'bin' / 'rollart'))} slurm-run "
        f"--topology {shlex.quote(str(topology_path))} <<'TABLE'",
        f"# {'node':<22} {'group':<6} {'cpus':<5} gpus",
        table,
        "TABLE",
        "",
    ]
    return "\n".join(lines)


def read_table(text: str) -> list[Placement]:
    """The script's table back (comment lines skipped)."""
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, group, cpus, gpus = line.split()
            rows.append(Placement(name, int(group), int(cpus), int(gpus)))
    return rows


# -- the job's supervisor ------------------------------------------------------------------------


def component_job_ids(env: dict[str, str], groups: int) -> list[str]:
    """The job id of each het-job component (its steps are `ID.STEP`)."""
    if groups == 1:
        return [env.get("SLURM_JOB_ID", "")]
    return [group_env(env, "SLURM_JOB_ID", g, groups) for g in range(groups)]


async def job_steps(job_ids: list[str]) -> dict[str, str]:
    """Step name (the node's, from `srun --job-name`) -> step id, of the running steps of these jobs."""
    squeue = await asyncio.create_subprocess_exec(
        "squeue",
        "--steps",
        "--noheader",
        "--format=%i|%j",
        f"--jobs={','.join(job_ids)}",
        stdout=subprocess.PIPE,
    )
    out, _ = await squeue.communicate()
    return {name: step for line in out.decode().splitlines() for step, _, name in [line.strip().partition("|")]}


@dataclass
class Step:
    """One node's job step, as the supervisor runs it."""

    spec: NodeSpec
    place: Placement
    host: str
    proc: asyncio.subprocess.Process | None = None
    restarts: collections.deque[float] = field(default_factory=collections.deque)


class Supervisor:
    """Runs every node of the job as its own step and applies its restart policy."""

    def __init__(
        self, topology: Topology, resolved: Path, steps: list[Step], groups: int, out: TextIO = sys.stdout
    ) -> None:
        self.topology, self.resolved, self.steps, self.groups, self.out = topology, resolved, steps, groups, out
        self.run_files = RunDir(topology.run_dir())
        self.logs = self.run_files.logs
        self.stopping: str | None = None
        self.failure: str | None = None
        self.job_ids: list[str] = []
        """The job ids of the het job's components, whose steps are the nodes."""
        self._stop = asyncio.Event()
        self._drains: set[asyncio.Future[None]] = set()

    def say(self, line: str) -> None:
        print(f"[rollart slurm {time.strftime('%H:%M:%S')}] {line}", file=self.out, flush=True)

    def command(self, step: Step) -> list[str]:
        p = step.place
        srun = ["srun"] + ([f"--het-group={p.group}"] if self.groups > 1 else [])
        srun += [
            f"--nodelist={step.host}",
            "--nodes=1",
            "--ntasks=1",
            "--exact",
            f"--cpus-per-task={p.cpus}",
            f"--job-name={p.name}",
            f"--output={self.run_files.node_log(p.name)}",
            "--open-mode=append",
            "--kill-on-bad-exit=1",
        ]
        if p.gpus:
            srun.append(f"--gpus-per-task={p.gpus}")
        node = [str(ROOT / "bin" / "rollart-node"), "--topology", str(self.resolved), "--node", p.name]
        return srun + node + (["--exit-when-done"] if is_the_trainer(step.spec) else [])

    async def run(self) -> int:
        self.logs.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # scancel: Slurm sends SIGTERM to every step's node itself (KillWait before SIGKILL).
            loop.add_signal_handler(sig, self.stop, f"{signal.Signals(sig).name} (scancel)", False)
        for step in self.steps:
            self.say(f"{step.spec.name} ({step.spec.role.value}) on {step.host}, component {step.place.group}")
        await asyncio.gather(*(self._supervise(step) for step in self.steps))
        for drain in list(self._drains):
            await drain
        if self.failure:
            print(f"rollart slurm: {self.failure}", file=sys.stderr, flush=True)
            self.say(f"job failed: {self.failure}")
            return EXIT_FAILED
        self.say(f"job done: {self.stopping or 'every node exited'}")
        return EXIT_OK

    def stop(self, why: str, signal_steps: bool = True) -> None:
        """Drain every node and restart none: SIGTERM to each running step's node through
        `scancel --signal=TERM JOB.STEP` (a SIGTERM to srun itself would make it kill its task),
        unless Slurm is doing so already (`signal_steps=False`: the job is being cancelled)."""
        if self.stopping is not None:
            return
        self.stopping = why
        self._stop.set()
        self.say(f"stopping: {why}; draining every node")
        if not signal_steps:
            return
        running = {step.spec.name for step in self.steps if step.proc is not None and step.proc.returncode is None}
        self._drains.add(task := asyncio.ensure_future(self._signal_steps(running)))
        task.add_done_callback(self._drains.discard)

    async def _signal_steps(self, names: set[str]) -> None:
        ids = await job_steps(self.job_ids)
        for name in sorted(names):
            if name not in ids:
                self.say(f"no job step found for {name} (it has ended, or not started yet)")
                continue
            done = await asyncio.create_subprocess_exec("scancel", "--signal=TERM", ids[name])
            if await done.wait() != 0:
                self.say(f"scancel --signal=TERM {ids[name]} ({name}) failed")

    async def _supervise(self, step: Step) -> None:
        name = step.spec.name
        log = self.run_files.node_log(name)
        while not self._stop.is_set():
            offset = log.stat().st_size if log.exists() else 0  # what this step writes comes after
            step.proc = await asyncio.create_subprocess_exec(*self.command(step), stdin=subprocess.DEVNULL)
            code = await step.proc.wait()
            # srun exits 128 + N when its task was killed by signal N.
            what = describe_end(name, 128 - code if code > 128 else code, log, offset)
            if self._stop.is_set():
                self.say(f"{what} while stopping")
                return
            if code == 0:
                self.say(f"{what}")
                if is_the_trainer(step.spec):
                    self.stop(f"{name} finished the run")
                return
            if code == 2:  # bad configuration: starting it again would fail the same way
                message = read_config_error(log, offset)
                self.failure = f"{what}: a configuration error" + (f": {message}" if message else "; see its log")
                self.stop(self.failure)
                return
            verdict = after_failure(self.topology.restart_policy(step.spec), step.restarts, time.monotonic())
            if verdict.action == "stop-all":
                self.failure = f"{what}; {verdict.why}"
                self.stop(self.failure)
                return
            self.say(f"{what}; {verdict.why}")
            if verdict.action == "leave":
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), verdict.delay)
            step.restarts.append(time.monotonic())


def run_job(topology_path: Path, table_text: str, env: dict[str, str] | None = None) -> int:
    """`rollart slurm-run`: inside the job, resolve the hosts and supervise every node."""
    env = dict(os.environ) if env is None else env
    try:
        topology = load_topology(topology_path)
        table = read_table(table_text)
        names = {p.name for p in table}
        if names != {n.name for n in topology.nodes}:
            raise ConfigError(
                f"the script's table names {sorted(names)}, the topology {[n.name for n in topology.nodes]}"
            )
        hosts = resolve_hosts(table, env)
        addresses = {name: node_address(host) for name, host in hosts.items()}
        resolved, moves = write_resolved(topology_path, addresses, env.get("SLURM_JOB_ID", "local"))
        topology = load_topology(resolved)
    except (ConfigError, subprocess.CalledProcessError, OSError) as exc:
        print(f"rollart slurm-run: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    groups = max(p.group for p in table) + 1
    steps = [Step(topology.node(p.name), p, hosts[p.name]) for p in table]
    supervisor = Supervisor(topology, resolved, steps, groups)
    supervisor.job_ids = component_job_ids(env, groups)
    for move in moves:
        supervisor.say(f"port moved: {move}")
    import uvloop

    return uvloop.run(supervisor.run())
