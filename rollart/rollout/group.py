"""A group: G + R trajectories of one task and seed; the first G to finish make the group.

The extra R trajectories are redundancy against slow and failing environments (the paper's
redundant environment rollout): as soon as G have finished, the rest are cancelled at once,
which aborts their generation calls on the generators and closes their environments. When so
many fail that G can no longer be reached, the group fails and the trainer re-issues it.

With `rollout.min_group_size` (the task's `min_size`) a group also has a **deadline**: the
`deadline_quantile` of its task's recent trajectory times (`GroupDeadlines`, one per env-host).
Past it, a group with at least `min_size` finished trajectories is done with those, and the
stragglers are cancelled as the extras are: a heavy-tailed environment no longer makes every group
wait for the slowest of its G. The times are learned from groups run without a deadline (the
first ones, then one in `CALIBRATE_EVERY`), so that the cut ones, whose times are unknown, do not
pull the estimate down. What it costs is a bias toward quick episodes (the cut are the slowest);
GRPO's advantages are taken within each group over the trajectories it kept.

With `rollout.max_redundancy` the extras adapt too: from the same times, each group gets as many as
make its task's groups cheapest (`GroupDeadlines.extras`): none where times are even, more where a
long tail makes the G-th of G the slowest of many.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

import structlog

from rollart.protocol.messages import GroupDone, GroupFailed, GroupTask, Trajectory

log = structlog.get_logger("rollart.rollout.group")

SAMPLES = 256
"""Recent trajectory times kept per task."""
MIN_SAMPLES = 32
"""Fewer times than this: no deadline yet."""
CALIBRATE_EVERY = 4
"""One group in this many runs without a deadline, so the times stay those of whole groups."""


class GroupDeadlines:
    """Per task: the deadline of a group, from the times of recent trajectories (seconds on the loop's clock)."""

    def __init__(self, quantile: float) -> None:
        self.quantile = quantile
        self.times: dict[str, collections.deque[float]] = {}
        self.groups: collections.Counter[str] = collections.Counter()
        self._cached: dict[str, float | None] = {}

    def deadline_s(self, task: str) -> float | None:
        """The deadline of the next group of `task` after its start; None: this group runs without one
        (too few times known, or a calibrating group)."""
        self.groups[task] += 1
        if self.groups[task] % CALIBRATE_EVERY == 0:
            return None
        if task not in self._cached:
            times = sorted(self.times.get(task, ()))
            self._cached[task] = times[int(self.quantile * (len(times) - 1))] if len(times) >= MIN_SAMPLES else None
        return self._cached[task]

    def extras(self, task: str, group_size: int, low: int, high: int) -> int:
        """The extras (from `low` to `high`) that make a group of `task` cheapest: G + R trajectories held
        until the G-th finishes, whose time is taken as the quantile G / (G + R + 1) of the recent times
        (where the G-th of G + R samples falls on average). `low` until enough times are known."""
        times = sorted(self.times.get(task, ()))
        if len(times) < MIN_SAMPLES or high <= low:
            return low

        def cost(extra: int) -> float:
            at = group_size / (group_size + extra + 1)
            return (group_size + extra) * times[int(at * (len(times) - 1))]

        return min(range(low, high + 1), key=cost)

    def record(self, task: str, times: list[float]) -> None:
        """The times of a group run without a deadline: each trajectory's until it finished, failed or
        was cancelled as a redundant extra (a lower bound on its time, above the G-th)."""
        self.times.setdefault(task, collections.deque(maxlen=SAMPLES)).extend(times)
        self._cached.pop(task, None)


async def run_group(
    task: GroupTask,
    run_one: Callable[[str], Awaitable[Trajectory]],
    deadlines: GroupDeadlines | None = None,
) -> GroupDone | GroupFailed:
    """Run `group_size + redundancy` trajectories and keep the first `group_size` to finish (or, past
    the deadline `deadlines` sets for a task with `min_size`, those finished if at least `min_size`)."""
    need = task.group_size
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = deadlines.deadline_s(task.task) if deadlines is not None and task.min_size else None
    tids = [f"{task.group_id}.{i}" for i in range(task.group_size + task.redundancy)]
    ids = {asyncio.ensure_future(run_one(tid)): tid for tid in tids}
    pending = set(ids)
    done: list[Trajectory] = []
    failures: list[str] = []
    times: list[float] = []
    cut = False
    try:
        while pending and len(done) < need and len(done) + len(pending) >= need:
            timeout = None
            if deadline is not None and len(done) >= task.min_size:
                timeout = max(0.0, started + deadline - loop.time())
            finished, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not finished:
                cut = True
                break
            times += [loop.time() - started] * len(finished)
            for future in finished:
                if future.cancelled():
                    failures.append("aborted")
                elif (exc := future.exception()) is not None:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    log.warning(
                        "group.trajectory_failed", group=task.group_id, trajectory=ids[future], error=failures[-1]
                    )
                else:
                    done.append(future.result())
    finally:
        if cut:
            why = f"past the group's deadline ({deadline:.1f} s): it finished with {len(done)} of {need}"
        elif len(done) >= need:
            why = f"a redundant extra: the group had its {need} trajectories"
        else:
            why = "the group failed"
        for future in pending:
            future.cancel(why)  # the extras: generation aborted, environment closed (an agent told why)
        await asyncio.gather(*pending, return_exceptions=True)
    if deadlines is not None and deadline is None:
        deadlines.record(task.task, times + [loop.time() - started] * len(pending))
    if cut:
        log.debug("group.deadline_cut", group=task.group_id, kept=len(done), of=need, deadline_s=deadline)
        return GroupDone(task.group_id, done, cancelled=len(pending), failed=len(failures), cut=len(pending))
    if len(done) >= need:
        return GroupDone(task.group_id, done[:need], cancelled=len(pending), failed=len(failures))
    reasons = "; ".join(sorted(set(failures)))[:500]
    return GroupFailed(task.group_id, f"{len(done)} of {need} trajectories finished ({reasons})")
