"""What a fault-injection run (rollart/testkit/harness.py) was and what it showed: the scenario, each
injected fault, the resource samples, the `Outcome`, and the checks of the invariants
(docs/reliability.md) over the run's records.

Each `check_*` function reads the run folder's records (timeline.jsonl, metrics.jsonl, the final
checkpoint's trainer state) and fills `Outcome.checks` with None when the invariant held, else what
was wrong. The trained lineage: a restarted trainer resumes from its last checkpoint and trains the
later steps again, so `timeline.jsonl` may hold a step twice (each line names the trainer's
incarnation); the last incarnation's record of each step is the one the final model descends from.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart import rundir
from rollart.rundir import RunDir

NEEDS_RANKS = ("kill-rank",)
"""Faults only a trainer with rank processes can take (`Scenario.fsdp_ranks` > 0)."""


@dataclass
class Scenario:
    """One run: which faults, how long, on which generator and trainer backends."""

    name: str
    faults: tuple[str, ...]
    """Injected in turn (`harness.FAULTS`); continuous ones are on for the whole run."""
    steps: int | None = 12
    duration_s: float | None = None
    """Stop the run after this long (a soak); with `steps` None it runs until then."""
    gap_s: tuple[float, float] = (3.0, 10.0)
    """Random pause between a recovery and the next injection."""
    injections: int | None = None
    """Stop injecting after this many faults (None: until `quiet_steps` before the end). With `steps`
    and `duration_s` None the run is drained `quiet_steps` steps after the last one was recovered
    from: however fast it trains, every fault is injected while it runs."""
    backend: str = "hf"
    fsdp_ranks: int = 0
    """0: the trainer trains on one device (`backend: torch`); N: `backend: fsdp2` with N rank
    processes (`kill-rank` needs them)."""
    checkpoint_every: int = 2
    weight_transport: str = "tcp"
    """`run.trainer.weights.transport`: "auto" pushes weights over UCX where ucxx imports (the default
    run's choice), "tcp" over the generators' session ports."""
    tls: bool = False
    """Every session, bulk connection and admin endpoint over TLS (`run.tls`, certificates made for the
    run); the partition fault needs plaintext (its proxy reads the role from the session's Hello)."""
    quiet_steps: int = 10
    """No fault is injected in the run's last this many steps: each one must be recovered from while
    the run still trains (a vLLM generator takes 30-50 s to start again here, the run a step a second)."""
    seed: int = 0
    sample_s: float = 0.5

    def __post_init__(self) -> None:
        if self.steps is None and self.duration_s is None and self.injections is None:
            raise ValueError(f"scenario {self.name}: give steps, duration_s or injections, or it never ends")
        if self.tls and "partition" in self.faults:
            raise ValueError(f"scenario {self.name}: the partition proxy cannot read roles through TLS")
        if self.fsdp_ranks < 1 and set(NEEDS_RANKS) & set(self.faults):
            raise ValueError(f"scenario {self.name}: {', '.join(NEEDS_RANKS)} needs a trainer with fsdp_ranks")


@dataclass
class Injection:
    kind: str
    target: str
    at: float
    """time.monotonic() of the injection."""
    healed: float | None = None
    """When a hang or partition ended (the process continued, the network healed), or the trainer
    whose rank was killed exited."""
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

    @classmethod
    def of_process(cls, t: float, node: str, status: dict[str, Any]) -> Sample | None:
        """The node's process as its /status names it, read from /proc (None: it is gone)."""
        pid = status["pid"]
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            rss_kb = next(int(line.split()[1]) for line in lines if line.startswith("VmRSS:"))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            return None
        return cls(t, node, pid, rss_kb / 1024, fds, status.get("asyncio_tasks", 0))


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


END_HEALTH_S = 3.0
"""Every node's last answer before the trainer was done must be this recent, and healthy."""


def check_run(
    o: Outcome,
    run_dir: Path,
    *,
    nodes: Iterable[str],
    end: float,
    health: dict[str, tuple[float, str]],
    generator_versions: dict[tuple[str, int], list[int]],
) -> None:
    """Fill `o.checks` from the run's records and what the harness saw: `health`, each node's health
    ("ok" or what was wrong) at its last answer before `end`, when the trainer was done; the versions
    each generator process reported."""
    o.checks["exit 0"] = None if o.exit_code == 0 else f"the launcher exited {o.exit_code}"
    blocks: dict[int, list[dict[str, Any]]] = {}
    timeline = read_jsonl(RunDir(run_dir).timeline)
    for (step, _), rows in itertools.groupby(timeline, key=lambda r: (r["step"], r["incarnation"])):
        blocks[step] = list(rows)  # a step trained again by a resumed trainer: the later one counts
    state = final_state(run_dir)
    check_steps(o, blocks, state)
    lineage = [row for step in sorted(blocks) for row in blocks[step]]
    trained_seeds = check_duplicates(o, lineage)
    check_lost(o, trained_seeds, state)
    stale = [r["trajectory_id"] for r in lineage if r["started_at_version"] < r["taken_at_version"] - 1]
    o.checks["alpha bound"] = None if not stale else f"started over alpha=1 versions before their batch: {stale}"
    check_versions(o, run_dir, generator_versions)
    sick = {
        name: problem if at > end - END_HEALTH_S else f"last answered {end - at:.1f} s before the end"
        for name in nodes
        for at, problem in [health.get(name, (0.0, "never answered"))]
        if problem != "ok" or at <= end - END_HEALTH_S
    }
    o.checks["every node healthy at the end"] = None if not sick else str(sick)
    stuck = [f"{i.kind} on {i.target}" for i in o.injections if i.recovery_s is None]
    o.checks["every fault recovered"] = None if not stuck else f"no recovery within the run: {stuck}"


def write_outcome(o: Outcome, path: Path, health: dict[str, tuple[float, str]]) -> None:
    """The checks and every fault as JSON (FOLDER/outcome.json), to read a failed run afterwards."""
    record = {
        "scenario": o.scenario.name,
        "exit_code": o.exit_code,
        "checks": o.checks,
        "injections": [
            {"kind": i.kind, "target": i.target, "recovery_s": i.recovery_s, "whole_s": i.whole and i.whole - i.at}
            for i in o.injections
        ],
        "continuous": dict(o.continuous),
        "health_at_end": {name: problem for name, (_, problem) in health.items()},
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def final_state(run_dir: Path) -> dict[str, Any]:
    """The newest checkpoint's trainer state ({} if none)."""
    import torch

    folder = RunDir(run_dir).latest_checkpoint()
    if folder is None:
        return {}
    return torch.load(RunDir(run_dir).trainer_state(folder), weights_only=False)  # type: ignore[no-any-return]


def check_steps(o: Outcome, blocks: dict[int, list[dict[str, Any]]], state: dict[str, Any]) -> None:
    """The run trained every step 1..steps, each a full batch, and checkpointed the last."""
    steps = o.scenario.steps
    final = state.get("step")
    o.steps_trained, o.trajectories = len(blocks), sum(len(rows) for rows in blocks.values())
    if steps is None:
        o.checks["reached its step count"] = None if blocks and final == max(blocks) else "no final checkpoint"
    elif sorted(blocks) != list(range(1, steps + 1)) or final != steps:
        trained = ranges(sorted(blocks))
        o.checks["reached its step count"] = f"trained {trained}, last checkpoint at step {final}; want 1-{steps}"
    else:
        o.checks["reached its step count"] = None
    short = {
        step: (len({r["group_id"] for r in rows}), len(rows))
        for step, rows in blocks.items()
        if len({r["group_id"] for r in rows}) != 2 or len(rows) != 4
    }
    o.checks["full batches (2 groups of 2)"] = None if not short else f"(groups, trajectories) by step: {short}"


def check_duplicates(o: Outcome, lineage: list[dict[str, Any]]) -> Counter[int]:
    """Trajectory ids and seeds trained more than once; returns how often each seed was trained."""
    twice = {tid: n for tid, n in Counter(row["trajectory_id"] for row in lineage).items() if n > 1}
    seeds = Counter(row["seed"] for row in {row["group_id"]: row for row in lineage}.values())
    seeds_twice = {seed: n for seed, n in seeds.items() if n > 1}
    o.duplicated = sum(n - 1 for n in twice.values()) + 2 * sum(n - 1 for n in seeds_twice.values())
    o.checks["no trajectory trained twice"] = None if not twice else f"trained more than once: {twice}"
    o.checks["no seed trained twice"] = None if not seeds_twice else f"trained more than once: {seeds_twice}"
    return seeds


def check_lost(o: Outcome, trained: Counter[int], state: dict[str, Any]) -> None:
    """Every seed the dispenser drew was trained, is owed (to run again) or was given up."""
    if not state:
        o.checks["nothing lost"] = "no checkpoint to account for the seeds drawn"
        return
    dispenser = state["dispenser"]
    base = o.scenario.seed * 1_000_003
    drawn = set(range(base + 1, dispenser["next_seed"] + 1))
    owed = {seed for _, seed, _ in dispenser["retry"]}
    given_up = set(dispenser.get("abandoned_seeds", []))
    o.abandoned = len(given_up)
    lost = drawn - set(trained) - owed - given_up
    o.lost = 2 * len(lost)
    o.checks["nothing lost"] = None if not lost else f"seeds never trained, owed or given up: {sorted(lost)}"


def check_versions(o: Outcome, run_dir: Path, generator_versions: dict[tuple[str, int], list[int]]) -> None:
    """The trained lineage's versions, and each generator process's (as /status said), only increase."""
    by_step = {row["step"]: row["version"] for row in read_jsonl(RunDir(run_dir).metrics) if "step" in row}
    lineage = [by_step[step] for step in sorted(by_step)]
    problems = []
    if any(b <= a for a, b in itertools.pairwise(lineage)):
        problems.append(f"trained lineage versions {lineage}")
    for (name, pid), seen in generator_versions.items():
        if any(b < a for a, b in itertools.pairwise(seen)):
            problems.append(f"{name} (pid {pid}) went from {max(seen)} back to a lower version")
    o.checks["versions only increase"] = "; ".join(problems) or None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines, every bad line skipped: a trainer killed mid-write and then resumed can leave a cut
    line in the middle of the file, not only at its end."""
    return rundir.read_jsonl(path, lenient=True) if path.exists() else []


def ranges(numbers: list[int]) -> str:
    if not numbers:
        return "none"
    return f"{numbers[0]}-{numbers[-1]} ({len(numbers)})"
