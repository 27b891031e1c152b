"""Fault injection into a real training run, and the checks that nothing was lost or trained twice.

`ChaosRun(scenario, folder, model).run()` writes a topology (a trainer, two generators behind partition
proxies, two env-hosts, a reward gateway; the tiny model; `tests.chaos.plugins` as the users'
env and reward modules), starts `rollart run` on it as a user would, and while it trains injects
the scenario's faults at random moments, one after another:

    kill-generator | kill-env-host | kill-reward | kill-trainer   SIGKILL; the launcher restarts it
    kill-rank    SIGKILL of one of the trainer's rank processes (`Scenario.fsdp_ranks`; pids from its
                 /status), at random; the trainer fails, is restarted and resumes from its checkpoint
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

The scenario, the outcome and the checks are rollart/testkit/outcome.py's. Used by tests/chaos/
(test_chaos.py, test_rank_kill.py), tests/slow/test_chaos_vllm.py, benchmarks/chaos.py (the table)
and benchmarks/soak.py.

One piece: `ChaosRun` is one run's life (topology, start, injections, the drain, the checks), each
step using what the one before left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from rollart.generation.registry import backend as generation_backend
from rollart.protocol.certs import NodeName, issue_for_nodes
from rollart.rundir import RunDir
from rollart.testkit.outcome import Injection, Outcome, Sample, Scenario, check_run, write_outcome
from rollart.testkit.proxy import PartitionProxy
from rollart.testkit.topology import TopologyBuilder
from rollart.topology import load_topology
from rollart.topology.exposure import admin_client

ROOT = Path(__file__).resolve().parents[2]
"""The repository: the run's working directory, on the nodes' PYTHONPATH (for `PLUGINS`)."""
PLUGINS = "tests.chaos.plugins"
"""The faulty env and reward modules, loaded by the nodes by name as a user's modules would be."""

FAULTS = (
    "kill-generator",
    "kill-env-host",
    "kill-reward",
    "kill-trainer",
    "kill-rank",
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
ENV_FAIL, ENV_HANG, REWARD_CRASH = 0.2, 0.02, 0.1
REWARD_CRASH_EXIT = 13
"""The exit code of a reward worker the plugin kills (`tests.chaos.plugins.crashy_env_reward`)."""
CHAOS_ENV = ["ROLLART_CHAOS_REWARD_CRASH", "ROLLART_CHAOS_REWARD_DELAY_S"]
"""The variables `PLUGINS`' reward function reads in the reward workers (`run.reward_pool.pass_env`)."""


TASKS = (  # tests/integration/cluster.py's two tasks: (name, env, env kwargs, profile, turns, tokens per turn)
    ("lake", "frozen-lake", {"actions": "letters", "compact": True, "corners": True}, "prefill-heavy", 4, 1),
    ("copy", "copy-reverse", {"mode": "copy", "min_len": 4, "max_len": 6, "alphabet": "ab"}, "decode-heavy", 1, 12),
)


def tasks(scenario: Scenario) -> list[dict[str, Any]]:
    """The run's tasks, made faulty as the scenario says."""
    out = []
    for name, inner, inner_kwargs, profile, turns, tokens in TASKS:
        env, kwargs = inner, inner_kwargs
        if "env-faults" in scenario.faults:  # rollart.tasks.flaky around the task's env, as a user's env
            env = "user-flaky"
            kwargs = {"inner": inner, **inner_kwargs, "reset_failure": ENV_FAIL, "step_failure": ENV_FAIL}
            kwargs |= {"hang_prob": ENV_HANG, "hang_s": 6.0}
        out.append(
            {
                "name": name,
                "env": env,
                "env_kwargs": kwargs,
                "profile": profile,
                "max_turns": turns,
                "max_tokens_per_turn": tokens,
                "reward": "crashy-env-reward" if "reward-crash" in scenario.faults else "env-reward",
            }
        )
    return out


class ChaosRun:
    """One scenario's training run with its faults; `run()` returns the `Outcome`."""

    def __init__(self, scenario: Scenario, folder: Path, model: Path) -> None:
        self.scenario, self.folder, self.model = scenario, folder, model
        self.rng = random.Random(scenario.seed)
        self.run_dir = folder / "run"
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
        self.admin_ssl: ssl.SSLContext | None = None
        """Set once the certificates are made (`Scenario.tls`): the admin endpoints speak HTTPS."""
        candidates = {"kill-generator": GENERATORS, "kill-env-host": ENV_HOSTS, "kill-reward": ("reward",)}
        candidates |= {"kill-trainer": ("trainer",), "kill-rank": ("trainer",), "hang": tuple(ROLES)}
        self.targets = {kind: itertools.cycle(self.rng.sample(nodes, len(nodes))) for kind, nodes in candidates.items()}
        """Each kind's targets in turn (in a random order), so every node of the kind is hit."""

    # -- set-up ---------------------------------------------------------------------------------

    def write_topology(self) -> Path:
        s = self.scenario
        builder = TopologyBuilder(
            self.run_dir,
            name=f"chaos-{s.name}",
            drain_timeout_s=10,
            restart={
                "policy": "on-failure",
                "max_restarts": 1000,
                "window_s": 600,
                "backoff_base_s": 0.5,
                "backoff_cap_s": 4,
            },
            session={"heartbeat_interval_s": 0.5, "heartbeat_deadline_s": HEARTBEAT_DEADLINE_S},
            env_modules=[PLUGINS],
            reward_modules=[PLUGINS],
            model={"path": self.model},
            generator={"backend": s.backend},
            reward_pool={"min_workers": 1, "max_workers": 2, "idle_timeout_s": 30, "pass_env": CHAOS_ENV},
            trainer={
                "lr": 0.002,
                "micro_batch_size": 16,
                "checkpoint_every": s.checkpoint_every,
                "threads": 1,
                "weights": {"transport": s.weight_transport},
                **({"backend": "fsdp2", "ranks": s.fsdp_ranks} if s.fsdp_ranks else {}),
            },
            rollout={
                "mode": "train",
                "schedule": "async",
                "tasks": tasks(s),
                "group_size": 2,
                # a group needs 2 trajectories of 4: most flaky episodes fail
                "redundancy": 2 if "env-faults" in s.faults else 0,
                "batch_groups": 2,
                "alpha": 1,
                "steps": s.steps,
                "groups_per_env_host": 2,
                "generate_timeout_s": 20,
                "env_timeout_s": 2,
                "reward_timeout_s": 10,
                "group_timeout_s": 120,
                "group_attempts": 10,
                "seed": s.seed,
            },
        )
        if s.tls:
            certs = self.folder / "certs"
            issue_for_nodes(certs, [NodeName(name) for name in ROLES])
            builder.run_section(tls={"dir": str(certs)})
        for name, role in ROLES.items():
            hardware = {"gen-compute": "compute", "gen-bandwidth": "bandwidth"}.get(name, "cpu")
            # peers dial the proxy; the generator listens behind it
            builder.node(name, role, hardware=hardware, behind_proxy=role == "generator")
        for name, given in builder.ports().items():
            self.ports[name] = (given.port, given.admin_port)
            if given.listen_port is not None:
                self.proxies[name] = PartitionProxy(given.port, given.listen_port)
        path = builder.write(self.folder / "topology.yaml")
        if s.tls:
            self.admin_ssl = admin_client(load_topology(path))[1]
        return path

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        for key in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN"):  # the launcher makes fresh ones
            env.pop(key, None)
        if "reward-crash" in self.scenario.faults:
            env["ROLLART_CHAOS_REWARD_CRASH"] = str(REWARD_CRASH)
        return env

    def python(self) -> str:
        venv = generation_backend(self.scenario.backend).venv
        return str(ROOT / venv.folder / "bin" / "python") if venv is not None else sys.executable

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
            connector = aiohttp.TCPConnector(ssl=self.admin_ssl) if self.admin_ssl is not None else None
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0), connector=connector) as http:
                watcher = asyncio.ensure_future(self._watch(http))
                injector = asyncio.ensure_future(self._inject_all(launcher))
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
        end = self.done_at or (self.step_times[-1] if self.step_times else 0.0)
        versions = self.generator_versions
        check_run(self.outcome, self.run_dir, nodes=ROLES, end=end, health=self.health, generator_versions=versions)
        write_outcome(self.outcome, self.folder / "outcome.json", self.health)
        return self.outcome

    async def _watch(self, http: aiohttp.ClientSession) -> None:
        """Poll every node's /status and the trainer's metrics file."""
        metrics = RunDir(self.run_dir).metrics
        seen, last_sample = 0, 0.0
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
            scheme = "https" if self.admin_ssl is not None else "http"
            async with http.get(f"{scheme}://127.0.0.1:{self.ports[name][1]}/status") as response:
                return await response.json() if response.status == 200 else None
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
            if status is not None and (sample := Sample.of_process(now, name, status)) is not None:
                self.outcome.samples.append(sample)

    # -- faults ---------------------------------------------------------------------------------

    async def _inject_all(self, launcher: asyncio.subprocess.Process) -> None:
        s = self.scenario
        kinds = [kind for kind in s.faults if kind not in CONTINUOUS]
        if kinds:
            await self.training.wait()
        for kind in itertools.cycle(kinds):
            await asyncio.sleep(self.rng.uniform(*s.gap_s))
            if self.done_at is not None or (s.steps is not None and len(self.step_times) >= s.steps - s.quiet_steps):
                return  # too late for a fault to be recovered from within the run
            if s.injections is not None and len(self.outcome.injections) >= s.injections:
                break
            injection = await self._inject(kind)
            self.outcome.injections.append(injection)
            await self._recovered(injection)
        if s.steps is None and s.duration_s is None:  # the run ends when its faults are behind it
            target = len(self.step_times) + s.quiet_steps
            while self.done_at is None:
                if len(self.step_times) >= target:
                    launcher.send_signal(signal.SIGTERM)  # the launcher drains every node, as Ctrl-C would
                    return
                await asyncio.sleep(s.sample_s)

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
        node, pid = target, status["pid"]
        if kind == "kill-rank":  # one of the rank processes the trainer's /status names
            rank, pid = self.rng.choice(list(enumerate(status["training"]["engine"]["pids"])))
            target = f"{node} rank {rank}"
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
            self.outcome.restarts[node] += 1
            if kind == "kill-rank":  # the trainer fails with its rank: the cluster is whole after it left
                injection.healed = await self._gone(status["pid"])
        return injection

    async def _gone(self, pid: int) -> float:
        """When process `pid` (the launcher's child) exited, as its pidfd says; RECOVERY_TIMEOUT_S at most."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            return time.monotonic()
        exited, loop = asyncio.Event(), asyncio.get_running_loop()
        loop.add_reader(fd, exited.set)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(exited.wait(), RECOVERY_TIMEOUT_S)
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        return time.monotonic()

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
        log = RunDir(self.run_dir).node_log("reward")
        if "reward-crash" in self.scenario.faults and log.exists():
            # Each injected crash is the plugin's `os._exit(REWARD_CRASH_EXIT)`, which the gateway logs
            # with that code (the worker, in its sandbox, can write nowhere the harness reads).
            crashed = f'"exit_code": {REWARD_CRASH_EXIT}'
            lines = log.read_text(errors="replace").splitlines()
            self.outcome.continuous["reward-crash"] = sum(
                1 for line in lines if "reward_worker_crashed" in line and crashed in line
            )
