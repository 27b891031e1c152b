"""The run's record of its training steps: a line per step in `metrics.jsonl` (copied to the trackers
`run.tracking` names), a line per trained trajectory in `timeline.jsonl`, and each generator's busy fraction
in `utilization.jsonl` (`rollart.rundir.RunDir`).

A step's line holds its batch's rewards and success (overall and per task, with 20-step moving averages),
trajectories per second, the statistics the training engine reported, each generator's busy fraction since the
last step (from the status generators report), and where the step's time went outside the train step: the
weights' way to the generators (given by the caller) and, per trajectory on average, its generation, env and
reward time. The timeline's lines are what the run report draws and what a fault-injection run's checks read.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from rollart.protocol.messages import NodeStatus
from rollart.rundir import JsonlLog, RunDir
from rollart.tracking.tracker import Tracker

if TYPE_CHECKING:
    from rollart.protocol.messages import GroupDone, Trajectory
    from rollart.tracking.config import TrackingSpec

MOVING_AVERAGE = 20
"""Steps in the moving averages of success and reward shown in progress and the report."""


class StepRecords:
    """Writes the run's step, trajectory and utilization records (module docstring)."""

    def __init__(
        self, run_dir: RunDir, *, peer_status: Mapping[str, NodeStatus], tracking: TrackingSpec | None = None
    ) -> None:
        """`peer_status` is the live map of the status peers last reported; `tracking` (`run.tracking`) names the
        trackers that get each metrics line too (None: none)."""
        self._peer_status = peer_status
        self.metrics = JsonlLog(run_dir.metrics)
        self.timeline = JsonlLog(run_dir.timeline)
        self.utilization = JsonlLog(run_dir.utilization)
        self.tracker = Tracker.from_spec(tracking, run_dir) if tracking is not None else None
        self.epoch_start = time.time()
        """Wall-clock time the run started (moved back by the elapsed time of a resumed run)."""
        self.last_step_at = time.monotonic()
        self.last: dict[str, Any] = {}
        """The last step's metrics line."""
        self.baseline: dict[str, dict[str, float]] = {}
        """Per task: the uniformly random valid policy's success rate and reward, measured at the start."""
        self._recent: dict[str, collections.deque[tuple[float, float]]] = {}
        self._busy: dict[str, tuple[float, float]] = {}

    def start(self, *, step: int = 0, elapsed_s: float | None = None) -> None:
        """The run starts at `step` (0: from scratch; after a checkpoint, the step after it), `elapsed_s` into
        it (None: when these records were made, as the trainer started): what an earlier life logged after that
        is gone from the trackers."""
        if elapsed_s is not None:
            self.epoch_start = time.time() - elapsed_s
        if self.tracker is not None:
            self.tracker.starts_at(step)

    def elapsed_s(self) -> float:
        return time.time() - self.epoch_start

    def write_baseline(self, baseline: dict[str, dict[str, float]]) -> None:
        self.baseline = baseline
        self.write({"baseline": True, "tasks": baseline})

    def write(self, line: dict[str, Any]) -> None:
        """A line of metrics.jsonl, handed to the trackers too (which write it on a thread of theirs)."""
        self.metrics.write([line])
        if self.tracker is not None:
            self.tracker.log(line)

    def step(
        self,
        step: int,
        version: int,
        batch: list[GroupDone],
        stats: Mapping[str, float],
        *,
        weights: Mapping[str, float],
        incarnation: int,
    ) -> dict[str, Any]:
        """Write the step's metrics (`stats`: the engine's; `weights`: the weight push's numbers, as
        `Learner.push_record` gives them) and its trajectories' timeline (whose lines name the trainer's
        `incarnation`, the dispenser's); return the metrics line."""
        now = time.monotonic()
        trajectories = [t for group in batch for t in group.trajectories]
        line = {
            "step": step,
            "elapsed_s": round(self.elapsed_s(), 3),
            "version": version,
            "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
            "success_rate": sum(t.success for t in trajectories) / len(trajectories),
            "tasks": self._tasks(trajectories),
            "traj_per_s": len(trajectories) / max(now - self.last_step_at, 1e-9),
            "generator_busy": self.generator_busy(),
            **{key: round(value, 6) for key, value in stats.items()},
        }
        if cut := sum(1 for group in batch if group.cut):
            line["groups_cut"] = cut  # finished short at their deadline (`rollout.min_group_size`)
        line |= self._elsewhere(trajectories) | dict(weights)
        self.last_step_at = now
        self.last = line
        self.write(line)
        self.timeline.write(self._timeline(step, version - 1, trajectories, incarnation))
        return line

    def _tasks(self, trajectories: list[Trajectory]) -> dict[str, dict[str, Any]]:
        """Per task: mean reward, success rate and count, with their moving averages."""
        tasks: dict[str, dict[str, Any]] = {}
        for task in sorted({t.task for t in trajectories}):
            mine = [t for t in trajectories if t.task == task]
            numbers = {
                "reward_mean": sum(t.reward for t in mine) / len(mine),
                "success_rate": sum(t.success for t in mine) / len(mine),
                "count": len(mine),
            }
            recent = self._recent.setdefault(task, collections.deque(maxlen=MOVING_AVERAGE))
            recent.append((numbers["success_rate"], numbers["reward_mean"]))
            numbers["success_ma"] = sum(s for s, _ in recent) / len(recent)
            numbers["reward_ma"] = sum(r for _, r in recent) / len(recent)
            tasks[task] = numbers
        return tasks

    def _elsewhere(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """The generators' last apply of weights (the slowest), and per trajectory of the batch on average its
        generation, env and reward time and its whole length."""
        applies = [
            float(status.load["apply_s"])
            for status in self._peer_status.values()
            if isinstance(status, NodeStatus) and "apply_s" in status.load
        ]
        spent = dict.fromkeys(("gen", "env", "reward"), 0.0)
        for t in trajectories:
            for kind, start, end in t.spans:
                if kind in spent:
                    spent[kind] += end - start
        n = max(len(trajectories), 1)
        return {
            "time_apply_s": round(max(applies, default=0.0), 6),
            **{f"traj_{kind}_s": round(total / n, 6) for kind, total in spent.items()},
            "traj_s": round(sum(t.finished_at - t.started_at for t in trajectories) / n, 6),
        }

    def _timeline(
        self, step: int, taken_at: int, trajectories: list[Trajectory], incarnation: int
    ) -> Iterable[dict[str, Any]]:
        """One line per trained trajectory: which group and seed it ran, the version it started at, the version
        its batch was taken at (`taken_at`), and the trainer's incarnation (a trainer resumed from a checkpoint
        trains the later steps again, and the last incarnation's lines are the ones the model descends from)."""
        t0 = self.epoch_start
        for t in trajectories:
            yield {
                "incarnation": incarnation,
                "trajectory_id": t.trajectory_id,
                "group_id": t.group_id,
                "task": t.task,
                "seed": t.seed,
                "step": step,
                "started_at_version": t.started_at_version,
                "taken_at_version": taken_at,
                "generators": sorted(set(t.generators)),
                "started_at": round(t.started_at - t0, 4),
                "finished_at": round(t.finished_at - t0, 4),
                "spans": [[kind, round(a - t0, 4), round(b - t0, 4)] for kind, a, b in t.spans],
            }

    def generator_busy(self) -> dict[str, float]:
        """Each generator's busy fraction since the last call, from the status generators report."""
        busy: dict[str, float] = {}
        samples = []
        elapsed = round(self.elapsed_s(), 3)
        for name, status in self._peer_status.items():
            if not isinstance(status, NodeStatus) or "busy_s" not in status.load:
                continue
            busy_s, up_s = status.load["busy_s"], status.load["engine_up_s"]
            prev_busy, prev_up = self._busy.get(name, (0.0, 0.0))
            if up_s < prev_up:  # the generator restarted
                prev_busy, prev_up = 0.0, 0.0
            if up_s > prev_up:
                busy[name] = round(min(1.0, (busy_s - prev_busy) / (up_s - prev_up)), 4)
                samples.append({"t": elapsed, "generator": name, "busy": busy[name]})
            self._busy[name] = (busy_s, up_s)
        self.utilization.write(samples)
        return busy

    def close(self) -> None:
        """End the trackers' runs (W&B, MLflow: finished) once their lines are written; blocks. Lines after it go
        to metrics.jsonl alone."""
        if self.tracker is not None:
            self.tracker.close()
