"""Held-out evaluation during a training run: pass@1 at temperature 0 and pass@k sampled.

`run.rollout.eval` (`EvalSpec`) names held-out twins of training tasks (a dataset's `split: heldout`).
Before the first step, every `every` steps and after the last, the trainer starts a round: for each eval
task, one group per problem (`problems` seeds from `first_seed`, the same every round) of 1 + k
trajectories, the first greedy (`GroupTask.greedy`), the others sampled as the run samples. The groups
are handed out ahead of training work and outside admission (a round is small, and training work waits
for nobody), never trained on, and never aborted as stale: a round measures the policy of the version
it started at (its calls wait for those weights on a generator still behind: `min_version`), though a
long one may see a newer version's weights for its later turns (the line says the range of versions its
tokens came from).

A problem is solved when its trajectory's episode succeeded (the env's `success`) or, where the env says
nothing of success, when its reward is at least `SOLVED_REWARD`. Per eval task a round gives
- `pass@1`: the share of problems the greedy trajectory solved;
- `pass@k`: the share solved by at least one of the k sampled ones, and `mean@k` their mean success;
- `problems`: how many problems came back (a group that failed or was lost is left out, and counted).

A round ends when every group is back, failed or lost (its env-host restarted, or `group_timeout_s`
passed); then one metrics line is written, `{"eval": true, "step": S, "version": V, "tasks": {...}}`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollart.protocol.messages import GroupDone, GroupTask, Trajectory
from rollart.rollout.config import EvalSpec, TaskSpec

log = structlog.get_logger("rollart.rollout.evaluation")

SOLVED_REWARD = 1.0
"""A trajectory whose env reports no `success` counts as solved from this reward on."""


def solved(trajectory: Trajectory) -> bool:
    return trajectory.success or trajectory.reward >= SOLVED_REWARD


@dataclass
class Out:
    """An eval group not back yet."""

    task: str
    env_host: str = ""
    """Who runs it; "" while it is queued."""
    granted_at: float = 0.0


@dataclass
class Round:
    """One evaluation: its groups out, and what came back."""

    step: int
    version: int
    out: dict[str, Out] = field(default_factory=dict)
    """Groups not back yet, by group id."""
    greedy: dict[str, list[bool]] = field(default_factory=dict)
    sampled: dict[str, list[list[bool]]] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    lost: dict[str, int] = field(default_factory=dict)

    def line(self, tasks: list[str], k: int) -> dict[str, Any]:
        figures: dict[str, dict[str, Any]] = {}
        for task in tasks:
            greedy, sampled = self.greedy.get(task, []), self.sampled.get(task, [])
            n = len(greedy)
            numbers: dict[str, Any] = {"problems": n, "lost": self.lost.get(task, 0)}
            if n:
                numbers["pass@1"] = sum(greedy) / n
                if k:
                    numbers[f"pass@{k}"] = sum(any(tries) for tries in sampled) / n
                    numbers[f"mean@{k}"] = sum(sum(tries) / len(tries) for tries in sampled) / n
            figures[task] = numbers
        line: dict[str, Any] = {"eval": True, "step": self.step, "version": self.version, "tasks": figures}
        if self.versions:
            line["versions"] = [min(self.versions), max(self.versions)]
        return line


class Evaluator:
    """The trainer's side of held-out evaluation: rounds of groups out, figures back (module docstring)."""

    def __init__(
        self,
        spec: EvalSpec,
        tasks: list[TaskSpec],
        *,
        write: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.tasks = [task.name for task in tasks]
        self.write = write
        """Takes each round's metrics line (the learner's metrics file and trackers)."""
        self.queue: list[GroupTask] = []
        self.rounds: dict[int, Round] = {}
        """Rounds still out, by the step they evaluate."""
        self.incarnation = 0
        """The trainer's incarnation, in group ids (as the dispenser's): a group from before a restart is never
        taken for one of this life's."""
        self._where: dict[str, int] = {}
        """Group id -> the step of its round."""
        self._idle = asyncio.Event()
        self._idle.set()

    def due(self, step: int, last: int | None) -> bool:
        """Whether step `step` (0: before the first) is evaluated: every `every`, and the last."""
        return step % self.spec.every == 0 or step == last

    def start(self, step: int, version: int) -> None:
        """Queue a round for the policy after `step` steps (at `version`)."""
        if step in self.rounds:
            return
        evaluation = Round(step, version)
        prefix = f"i{self.incarnation}." if self.incarnation else ""
        for task in self.tasks:
            for seed in range(self.spec.first_seed, self.spec.first_seed + self.spec.problems):
                group = GroupTask(
                    group_id=f"{prefix}e{step}.{task}.{seed}",
                    task=task,
                    seed=seed,
                    group_size=1 + self.spec.k,
                    redundancy=0,
                    version=version,
                    greedy=1,
                    evaluation=True,
                )
                self.queue.append(group)
                evaluation.out[group.group_id] = Out(task)
                self._where[group.group_id] = step
        self.rounds[step] = evaluation
        self._idle.clear()
        log.info("eval.start", step=step, version=version, groups=len(evaluation.out))

    def grant(self, env_host: str) -> GroupTask | None:
        """The next queued eval group for `env_host`, or None."""
        if not self.queue:
            return None
        group = self.queue.pop(0)
        evaluation = self.rounds[self._where[group.group_id]]
        evaluation.out[group.group_id] = Out(group.task, env_host, self.clock())
        return group

    def owns(self, group_id: str) -> bool:
        return group_id in self._where

    def done(self, group: GroupDone) -> None:
        """A group came back: greedy first, then the sampled tries (ordered by trajectory index)."""
        evaluation = self._take(group.group_id)
        if evaluation is None:
            return
        by_index = sorted(group.trajectories, key=lambda t: int(t.trajectory_id.rsplit(".", 1)[1]))
        task = group.trajectories[0].task
        evaluation.greedy.setdefault(task, []).append(solved(by_index[0]))
        evaluation.sampled.setdefault(task, []).append([solved(t) for t in by_index[1:]])
        evaluation.versions += [v for t in group.trajectories for v in t.versions if v >= 0]
        self._maybe_finish(evaluation)

    def lose(self, group_id: str, reason: str) -> None:
        """A group failed or was lost: the round goes on without it."""
        evaluation = self.rounds.get(self._where.get(group_id, -1))
        if evaluation is None or group_id not in evaluation.out:
            return
        task = evaluation.out[group_id].task
        self._take(group_id)
        evaluation.lost[task] = evaluation.lost.get(task, 0) + 1
        log.warning("eval.group_lost", group=group_id, reason=reason)
        self._maybe_finish(evaluation)

    def release_env_host(self, env_host: str, reason: str) -> None:
        for evaluation in list(self.rounds.values()):
            for group_id, out in list(evaluation.out.items()):
                if out.env_host == env_host:
                    self.lose(group_id, reason)

    def expire(self, timeout_s: float) -> None:
        """Lose the groups granted more than `timeout_s` ago and not back (the trainer's lease check)."""
        now = self.clock()
        for evaluation in list(self.rounds.values()):
            for group_id, out in list(evaluation.out.items()):
                if out.env_host and now - out.granted_at > timeout_s:
                    self.lose(group_id, f"not returned within {timeout_s} s")

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no round is out (True), or `timeout` seconds (False)."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def _take(self, group_id: str) -> Round | None:
        step = self._where.pop(group_id, None)
        evaluation = self.rounds.get(step) if step is not None else None
        if evaluation is None:
            return None
        evaluation.out.pop(group_id, None)
        self.queue = [group for group in self.queue if group.group_id != group_id]
        return evaluation

    def _maybe_finish(self, evaluation: Round) -> None:
        if evaluation.out:
            return
        del self.rounds[evaluation.step]
        line = evaluation.line(self.tasks, self.spec.k)
        self.write(line)
        figures = {task: {k: v for k, v in numbers.items() if "@" in k} for task, numbers in line["tasks"].items()}
        log.info("eval.done", step=evaluation.step, version=evaluation.version, **figures)
        if not self.rounds:
            self._idle.set()
