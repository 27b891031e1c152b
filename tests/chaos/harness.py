"""Fault injection into a real training run, and the checks that nothing was lost or trained twice.

`ChaosRun(scenario, folder, model).run()` writes a topology (a trainer, two generators behind partition
proxies, two env-hosts, a reward gateway; the tiny model; `tests.chaos.plugins` as the users'
env and reward modules), starts `rollart run` on it as a user would, and while it trains injects
the scenario's faults at random moments, one after another:

    kill-generator | kill-env-host | kill-reward | kill-trainer   SIGKILL; the launcher restarts it
    hang         SIGSTOP of each node in turn for the heartbeat deadline + 2 s, then SIGCONT
    partition    env-hosts cut off from the generators for 10 s (`PartitionProxy`), then healed
    env-faults   every env reset and step fails with probability 0.2 and hangs past env_timeout_s
                 with probability 0.02 (`rollart.tasks.flaky` as a user's env, in env worker
                 processes, killed when a call hangs; continuous)
    reward-crash reward workers die mid-request with probability 0.1 (continuous)

After each injected fault it waits until the cluster is whole again (every node answers `/status`
running, every session up) and the trainer completes a step: the fault's recovery time is from the
injection to that step. When the run ends, `Outcome.checks` holds the invariants
(docs/reliability.md): the run reached its step count and exited 0; every step trained a full batch; no
trajectory id and no environment seed was trained twice; every seed drawn was trained, is still
owed (in the final checkpoint's retry line), or was given up on its last try (nothing lost); every
trajectory obeyed alpha; versions only increased (the trained lineage, and each generator process);
every node was healthy when the trainer finished; every fault recovered.

The trained lineage: a restarted trainer resumes from its last checkpoint and trains the later
steps again, so `timeline.jsonl` may hold a step twice (each line names the trainer's incarnation);
the last incarnation's record of each step is the one the final model descends from.

Used by tests/chaos/test_chaos.py, benchmarks/chaos.py (the table) and benchmarks/soak.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.chaos.proxy import PartitionProxy
from tests.support import ROOT, free_ports

FAULTS = (
    "kill-generator",
    "kill-env-host",
    "kill-reward",
    "kill-trainer",
    "hang",
    "partition",
    "env-faults",
    "reward-crash",
)
CONTINUOUS = ("env-faults", "reward-crash")
"""Faults that are part of the run's parts (envs, reward workers) rather than injected by the harness."""
GENERATORS = ("gen-compute", "gen-bandwidth")
ENV_HOSTS = ("env-0", "env-1")
ROLES = {"trainer": "trainer", **dict.fromkeys(GENERATORS, "generator"), **dict.fromkeys(ENV_HOSTS, "env-host")}
ROLES["reward"] = "reward-gateway"
HEARTBEAT_DEADLINE_S = 3.0
PARTITION_S = 10.0
RECOVERY_TIMEOUT_S = 240.0
END_HEALTH_S = 3.0
"""Every node's last answer before the trainer was done must be this recent, and healthy."""
ENV_FAIL, ENV_HANG, REWARD_CRASH = 0.2, 0.02, 0.1


@dataclass
class Scenario:
    """One run: which faults, how long, on which generator backend."""

    name: str
    faults: tuple[str, ...]
    """Injected in turn (`FAULTS`); continuous ones are on for the whole run."""
    steps: int | None = 12
    duration_s: float | None = None
    """Stop the run after this long (a soak); with `steps` None it runs until then."""
    gap_s: tuple[float, float] = (3.0, 10.0)
    """Random pause between a recovery and the next injection."""
    backend: str = "hf"
    checkpoint_every: int = 2
    quiet_steps: int = 10
    """No fault is injected in the run's last this many steps: each one must be recovered from while
    the run still trains (a vLLM generator takes 30-50 s to start again here, the run a step a second)."""
    seed: int = 0
    sample_s: float = 0.5


@dataclass
class Injection:
    kind: str
    target: str
    at: float
    """time.monotonic() of the injection."""
    healed: float | None = None
    """When a hang or partition ended (the process continued, the network healed)."""
    whole: float | None = None
    """When every node answered running with every session up again."""
    stepped: float | None = None
    """When the trainer finished a step after that."""

    @property
    def recovery_s(self) -> float | None:
        return None if self.stepped is None else self.stepped - self.at


@dataclass
class Sample:
    """One node's resources at one moment (the soak's plot)."""

    t: float
    node: str
    pid: int
    rss_mb: float
    fds: int
    tasks: int


@dataclass
class Outcome:
    scenario: Scenario
    exit_code: int | None
    injections: list[Injection]
    continuous: Counter[str]
    """Continuous faults that took effect, by kind: "env-faults", env calls that failed or timed out
    (the env-hosts' count); "reward-crash", reward workers that died (the plugin's log)."""
    checks: dict[str, str | None] = field(default_factory=dict)
    """Check name -> None when it held, else what was wrong."""
    steps_trained: int = 0
    trajectories: int = 0
    lost: int = 0
    """Trajectories lost: groups of seeds drawn but neither trained, owed nor given up, times G."""
    duplicated: int = 0
    abandoned: int = 0
    samples: list[Sample] = field(default_factory=list)
    restarts: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    folder: Path = Path()

    @property
    def ok(self) -> bool:
        return all(problem is None for problem in self.checks.values())

    def explain(self) -> str:
        failed = {name: problem for name, problem in self.checks.items() if problem is not None}
        return "; ".join(f"{name}: {problem}" for name, problem in failed.items()) or "all checks held"


TASKS = (  # tests/integration/cluster.py's two tasks: (name, env, env kwargs, profile, turns, tokens per turn)
    ("lake", "frozen-lake", {"actions": "letters", "compact": True, "corners": True}, "prefill-heavy", 4, 1),
    ("copy", "copy-reverse", {"mode": "copy", "min_len": 4, "max_len": 6, "alphabet": "ab"}, "decode-heavy", 1, 12),
)


def task_yaml(scenario: Scenario) -> str:
    """The run's tasks (YAML flow mappings), made faulty as the scenario says."""
    lines = []
    for name, inner, inner_kwargs, profile, turns, tokens in TASKS:
        env, kwargs = inner, inner_kwargs
        if "env-faults" in scenario.faults:  # rollart.tasks.flaky around the task's env, as a user's env
            env = "user-flaky"
            kwargs = {"inner": inner, **inner_kwargs, "reset_failure": ENV_FAIL, "step_failure": ENV_FAIL}
            kwargs |= {"hang_prob": ENV_HANG, "hang_s": 6.0}
        task = {
            "name": name,
            "env": env,
            "env_kwargs": kwargs,
            "profile": profile,
            "max_turns": turns,
            "max_tokens_per_turn": tokens,
            "reward": "crashy-env-reward" if "reward-crash" in scenario.faults else "env-reward",
        }
        lines.append(f"      - {json.dumps(task)}")
    return "\n".join(lines)


class ChaosRun:
    """One scenario's training run with its faults; `run()` returns the `Outcome`."""

    def __init__(self, scenario: Scenario, folder: Path, model: Path) -> None:
        self.scenario, self.folder, self.model = scenario, folder, model
        self.rng = random.Random(scenario.seed)
        self.run_dir = folder / "run"
        self.fault_log = folder / "faults.log"
        self.ports: dict[str, tuple[int, int]] = {}
        self.proxies: dict[str, PartitionProxy] = {}
        self.status: dict[str, tuple[float, dict[str, Any] | None]] = {}
        """Each node's latest /status (None: it did not answer), with when it was read."""
        self.step_times: list[float] = []
        """When the watcher saw each line of metrics.jsonl appear (a trained step)."""
        self.training = asyncio.Event()
        """Set at the first trained step."""
        self.done_at: float | None = None
        """When the trainer was first seen done, or a node draining (the launcher drains them all at once)."""
        self.health: dict[str, tuple[float, str]] = {}
        """Each node's health ("ok" or what is wrong) at its last answer before the trainer was done."""
        self.generator_versions: dict[tuple[str, int], list[int]] = {}
        self.env_failures: dict[tuple[str, int], int] = {}
        """Each env-host process's latest count of env calls that failed or timed out."""
        self.outcome = Outcome(scenario, None, [], Counter(), folder=folder)
        candidates = {"kill-generator": GENERATORS, "kill-env-host": ENV_HOSTS, "kill-reward": ("reward",)}
        candidates |= {"kill-trainer": ("trainer",), "hang": tuple(ROLES)}
        self.targets = {kind: itertools.cycle(self.rng.sample(nodes, len(nodes))) for kind, nodes in candidates.items()}
        """Each kind's targets in turn (in a random order), so every node of the kind is hit."""

    # -- set-up ---------------------------------------------------------------------------------

    def write_topology(self) -> Path:
        s = self.scenario
        ports = iter(free_ports(3 * len(ROLES)))
        nodes = []
        for name, role in ROLES.items():
            port, admin = next(ports), next(ports)
            self.ports[name] = (port, admin)
            hardware = {"gen-compute": "compute", "gen-bandwidth": "bandwidth"}.get(name, "cpu")
            line = f"  - {{name: {name}, role: {role}, hardware: {hardware}, port: {port}, admin_port: {admin}"
            if role == "generator":  # peers dial the proxy; the generator listens behind it
                listen = next(ports)
                self.proxies[name] = PartitionProxy(port, listen)
                line += f", listen_port: {listen}"
            nodes.append(line + "}")
        steps = "null" if s.steps is None else s.steps
        redundancy = 2 if "env-faults" in s.faults else 0  # a group needs 2 trajectories of 4: most flaky episodes fail
        text = (
            f"""run:
  name: chaos-{s.name}
  run_dir: {self.run_dir}
  drain_timeout_s: 10
  restart: {{policy: on-failure, max_restarts: 1000, window_s: 600, backoff_base_s: 0.5, backoff_cap_s: 4}}
  session: {{heartbeat_interval_s: 0.5, heartbeat_deadline_s: {HEARTBEAT_DEADLINE_S}}}
  env_modules: [tests.chaos.plugins]
  reward_modules: [tests.chaos.plugins]
  model: {{path: {self.model}}}
  generator: {{backend: {s.backend}}}
  reward_pool: {{min_workers: 1, max_workers: 2, idle_timeout_s: 30}}
  trainer: {{lr: 0.002, micro_batch_size: 16, checkpoint_every: {s.checkpoint_every}, threads: 1,
             weight_transport: tcp}}
  rollout:
    mode: train
    schedule: async
    tasks:
{task_yaml(s)}
    group_size: 2
    redundancy: {redundancy}
    batch_groups: 2
    alpha: 1
    steps: {steps}
    groups_per_env_host: 2
    generate_timeout_s: 20
    env_timeout_s: 2
    reward_timeout_s: 10
    group_timeout_s: 120
    group_attempts: 10
    seed: {s.seed}
nodes:
"""
            + "\n".join(nodes)
            + "\n"
        )
        path = self.folder / "topology.yaml"
        path.write_text(text)
        return path

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "ROLLART_CHAOS_LOG": str(self.fault_log)}
        for key in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN"):  # the launcher makes fresh ones
            env.pop(key, None)
        if "reward-crash" in self.scenario.faults:
            env["ROLLART_CHAOS_REWARD_CRASH"] = str(REWARD_CRASH)
        return env

    def python(self) -> str:
        if self.scenario.backend == "vllm":
            return str(ROOT / ".venv-vllm" / "bin" / "python")
        return sys.executable

    # -- the run --------------------------------------------------------------------------------

    async def run(self) -> Outcome:
        self.folder.mkdir(parents=True, exist_ok=True)
        topology = self.write_topology()
        started = time.monotonic()
        for proxy in self.proxies.values():
            await proxy.start()
        command = [self.python(), "-m", "rollart.cli", "run", str(topology)]
        if self.scenario.duration_s is not None:
            command += ["--duration", str(self.scenario.duration_s)]
        with (self.folder / "launcher.log").open("wb") as out:
            launcher = await asyncio.create_subprocess_exec(
                *command, cwd=ROOT, env=self.environment(), stdout=out, stderr=subprocess.STDOUT
            )
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
                watcher = asyncio.ensure_future(self._watch(http))
                injector = asyncio.ensure_future(self._inject_all())
                self.outcome.exit_code = await launcher.wait()
                injector.cancel()
                watcher.cancel()
                for result in await asyncio.gather(injector, watcher, return_exceptions=True):
                    if isinstance(result, Exception):  # a bug of the harness, not a fault of the run
                        raise result
        finally:
            self._continue_all()
            if launcher.returncode is None:
                launcher.kill()
                await launcher.wait()
            for proxy in self.proxies.values():
                await proxy.close()
        self.outcome.wall_s = time.monotonic() - started
        self._count_continuous()
        self.check()
        self._write_outcome()
        return self.outcome

    def _write_outcome(self) -> None:
        """FOLDER/outcome.json: the checks and every fault, to read a failed run afterwards."""
        o = self.outcome
        record = {
            "scenario": self.scenario.name,
            "exit_code": o.exit_code,
            "checks": o.checks,
            "injections": [
                {"kind": i.kind, "target": i.target, "recovery_s": i.recovery_s, "whole_s": i.whole and i.whole - i.at}
                for i in o.injections
            ],
            "continuous": dict(o.continuous),
            "health_at_end": {name: problem for name, (_, problem) in self.health.items()},
        }
        (self.folder / "outcome.json").write_text(json.dumps(record, indent=2) + "\n")

    async def _watch(self, http: aiohttp.ClientSession) -> None:
        """Poll every node's /status and the trainer's metrics file."""
        metrics = self.run_dir / "metrics.jsonl"
        seen = 0
        last_sample = 0.0
        while True:
            now = time.monotonic()
            replies = await asyncio.gather(*(self._status(http, name) for name in ROLES))
            for name, reply in zip(ROLES, replies, strict=True):
                self.status[name] = (now, reply)
                if reply is not None and name in GENERATORS and reply.get("version") is not None:
                    self.generator_versions.setdefault((name, reply["pid"]), []).append(reply["version"])
                if reply is not None and name in ENV_HOSTS and "rollout" in reply:
                    self.env_failures[(name, reply["pid"])] = reply["rollout"].get("env_failures", 0)
            lines = metrics.read_bytes().count(b'{"step":') if metrics.exists() else 0  # not the baseline line
            self.step_times += [now] * (lines - seen)
            if self.step_times:
                self.training.set()
            seen = max(seen, lines)
            trainer = self.status["trainer"][1]
            draining = any(reply is not None and reply["state"] == "draining" for reply in replies)
            if self.done_at is None and (draining or (trainer is not None and trainer.get("done"))):
                self.done_at = now  # the launcher drains every node at once: the end of the run
            if self.done_at is None:
                for name, reply in zip(ROLES, replies, strict=True):
                    if reply is not None:
                        self.health[name] = (now, self._health(name))
            if self.scenario.duration_s is not None and now - last_sample >= 5.0:
                last_sample = now
                self._sample(now)
            await asyncio.sleep(self.scenario.sample_s)

    async def _status(self, http: aiohttp.ClientSession, name: str) -> dict[str, Any] | None:
        try:
            async with http.get(f"http://127.0.0.1:{self.ports[name][1]}/status") as response:
                return await response.json() if response.status == 200 else None  # type: ignore[no-any-return]
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    def _health(self, name: str) -> str:
        """ "ok", or what is wrong with the node by its latest /status."""
        _, status = self.status.get(name, (0.0, None))
        if status is None:
            return "no answer"
        if status["state"] not in ("running", "draining"):
            return f"state {status['state']}"
        down = [s["peer"] for s in status["sessions"]["outgoing"] if s["state"] != "up"]
        return f"sessions to {', '.join(down)} not up" if down else "ok"

    def _whole(self, since: float) -> bool:
        """Every node answered after `since`, running, with every session up."""
        return all(at > since and self._health(name) == "ok" for name, (at, _) in self.status.items())

    def _sample(self, now: float) -> None:
        for name in ROLES:
            _, status = self.status.get(name, (0.0, None))
            if status is None:
                continue
            pid = status["pid"]
            try:
                rss_kb = next(
                    int(line.split()[1])
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS:")
                )
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration):
                continue
            self.outcome.samples.append(Sample(now, name, pid, rss_kb / 1024, fds, status.get("asyncio_tasks", 0)))

    # -- faults ---------------------------------------------------------------------------------

    async def _inject_all(self) -> None:
        s = self.scenario
        kinds = [kind for kind in s.faults if kind not in CONTINUOUS]
        if not kinds:
            return
        await self.training.wait()
        for kind in itertools.cycle(kinds):
            await asyncio.sleep(self.rng.uniform(*s.gap_s))
            if self.done_at is not None or (s.steps is not None and len(self.step_times) >= s.steps - s.quiet_steps):
                return  # too late for a fault to be recovered from within the run
            injection = await self._inject(kind)
            self.outcome.injections.append(injection)
            await self._recovered(injection)

    async def _inject(self, kind: str) -> Injection:
        if kind == "partition":
            injection = Injection(kind, "env-hosts / generators", time.monotonic())
            for proxy in self.proxies.values():
                proxy.cut({"env-host"})
            await asyncio.sleep(PARTITION_S)
            for proxy in self.proxies.values():
                proxy.heal()
            injection.healed = time.monotonic()
            return injection
        target = next(self.targets[kind])
        _, status = self.status[target]
        assert status is not None, f"{target} is not answering before the fault"
        pid = status["pid"]
        injection = Injection(kind, target, time.monotonic())
        if kind == "hang":
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(HEARTBEAT_DEADLINE_S + 2.0)
            finally:
                os.kill(pid, signal.SIGCONT)
            injection.healed = time.monotonic()
        else:
            os.kill(pid, signal.SIGKILL)
            self.outcome.restarts[target] += 1
        return injection

    async def _recovered(self, injection: Injection) -> None:
        """Wait until the cluster is whole again and has trained a step since; give up after a while."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        since = injection.healed or injection.at
        while time.monotonic() < deadline and self.done_at is None:
            if injection.whole is None and self._whole(since + 0.5):
                injection.whole = time.monotonic()
            if injection.whole is not None:
                after = [t for t in self.step_times if t > injection.whole]
                if after:
                    injection.stepped = after[0]
                    return
            await asyncio.sleep(0.25)

    def _continue_all(self) -> None:
        """A node left stopped by a cancelled hang would never drain."""
        for _, status in self.status.values():
            if status is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(status["pid"], signal.SIGCONT)

    def _count_continuous(self) -> None:
        if "env-faults" in self.scenario.faults:
            self.outcome.continuous["env-faults"] = sum(self.env_failures.values())
        if self.fault_log.exists():
            for line in self.fault_log.read_text().splitlines():
                self.outcome.continuous[line.split()[2]] += 1

    # -- the checks -----------------------------------------------------------------------------

    def check(self) -> None:
        """Fill `outcome.checks` from the run's records (see the module docstring)."""
        o = self.outcome
        o.checks["exit 0"] = None if o.exit_code == 0 else f"the launcher exited {o.exit_code}"
        blocks: dict[int, list[dict[str, Any]]] = {}
        timeline = _read_jsonl(self.run_dir / "timeline.jsonl")
        for (step, _), rows in itertools.groupby(timeline, key=lambda r: (r["step"], r["incarnation"])):
            blocks[step] = list(rows)  # a step trained again by a resumed trainer: the later one counts
        state = self._final_state()
        self._check_steps(blocks, state)
        lineage = [row for step in sorted(blocks) for row in blocks[step]]
        trained_seeds = self._check_duplicates(lineage)
        self._check_lost(trained_seeds, state)
        stale = [r["trajectory_id"] for r in lineage if r["started_at_version"] < r["taken_at_version"] - 1]
        o.checks["alpha bound"] = None if not stale else f"started over alpha=1 versions before their batch: {stale}"
        self._check_versions()
        end = self.done_at or (self.step_times[-1] if self.step_times else 0.0)
        sick = {
            name: problem if at > end - END_HEALTH_S else f"last answered {end - at:.1f} s before the end"
            for name in ROLES
            for at, problem in [self.health.get(name, (0.0, "never answered"))]
            if problem != "ok" or at <= end - END_HEALTH_S
        }
        o.checks["every node healthy at the end"] = None if not sick else str(sick)
        stuck = [f"{i.kind} on {i.target}" for i in o.injections if i.recovery_s is None]
        o.checks["every fault recovered"] = None if not stuck else f"no recovery within the run: {stuck}"

    def _final_state(self) -> dict[str, Any]:
        """The newest checkpoint's trainer state ({} if none)."""
        import torch

        latest = self.run_dir / "checkpoints" / "latest"
        if not latest.exists():
            return {}
        folder = self.run_dir / "checkpoints" / latest.read_text().strip()
        return torch.load(folder / "trainer.pt", weights_only=False)  # type: ignore[no-any-return]

    def _check_steps(self, blocks: dict[int, list[dict[str, Any]]], state: dict[str, Any]) -> None:
        o, steps = self.outcome, self.scenario.steps
        final = state.get("step")
        o.steps_trained, o.trajectories = len(blocks), sum(len(rows) for rows in blocks.values())
        if steps is None:
            o.checks["reached its step count"] = None if blocks and final == max(blocks) else "no final checkpoint"
        elif sorted(blocks) != list(range(1, steps + 1)) or final != steps:
            trained = _ranges(sorted(blocks))
            o.checks["reached its step count"] = f"trained {trained}, last checkpoint at step {final}; want 1-{steps}"
        else:
            o.checks["reached its step count"] = None
        short = {
            step: (len({r["group_id"] for r in rows}), len(rows))
            for step, rows in blocks.items()
            if len({r["group_id"] for r in rows}) != 2 or len(rows) != 4
        }
        o.checks["full batches (2 groups of 2)"] = None if not short else f"(groups, trajectories) by step: {short}"

    def _check_duplicates(self, lineage: list[dict[str, Any]]) -> Counter[int]:
        """Trajectory ids and seeds trained more than once; returns how often each seed was trained."""
        o = self.outcome
        twice = {tid: n for tid, n in Counter(row["trajectory_id"] for row in lineage).items() if n > 1}
        seeds = Counter(row["seed"] for row in {row["group_id"]: row for row in lineage}.values())
        seeds_twice = {seed: n for seed, n in seeds.items() if n > 1}
        o.duplicated = sum(n - 1 for n in twice.values()) + 2 * sum(n - 1 for n in seeds_twice.values())
        o.checks["no trajectory trained twice"] = None if not twice else f"trained more than once: {twice}"
        o.checks["no seed trained twice"] = None if not seeds_twice else f"trained more than once: {seeds_twice}"
        return seeds

    def _check_lost(self, trained: Counter[int], state: dict[str, Any]) -> None:
        """Every seed the dispenser drew was trained, is owed (to run again) or was given up."""
        o = self.outcome
        if not state:
            o.checks["nothing lost"] = "no checkpoint to account for the seeds drawn"
            return
        dispenser = state["dispenser"]
        base = self.scenario.seed * 1_000_003
        drawn = set(range(base + 1, dispenser["next_seed"] + 1))
        owed = {seed for _, seed, _ in dispenser["retry"]}
        given_up = set(dispenser.get("abandoned_seeds", []))
        o.abandoned = len(given_up)
        lost = drawn - set(trained) - owed - given_up
        o.lost = 2 * len(lost)
        o.checks["nothing lost"] = None if not lost else f"seeds never trained, owed or given up: {sorted(lost)}"

    def _check_versions(self) -> None:
        """The trained lineage's versions, and each generator process's, only increase."""
        by_step = {row["step"]: row["version"] for row in _read_jsonl(self.run_dir / "metrics.jsonl") if "step" in row}
        lineage = [by_step[step] for step in sorted(by_step)]
        problems = []
        if any(b <= a for a, b in itertools.pairwise(lineage)):
            problems.append(f"trained lineage versions {lineage}")
        for (name, pid), seen in self.generator_versions.items():
            if any(b < a for a, b in itertools.pairwise(seen)):
                problems.append(f"{name} (pid {pid}) went from {max(seen)} back to a lower version")
        self.outcome.checks["versions only increase"] = "; ".join(problems) or None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines; a cut last line (a killed writer) is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def _ranges(numbers: list[int]) -> str:
    if not numbers:
        return "none"
    return f"{numbers[0]}-{numbers[-1]} ({len(numbers)})"
