"""A group: G + R trajectories of one task and seed; the first G to finish make the group.

The extra R trajectories are redundancy against slow and failing environments (the paper's
redundant environment rollout): as soon as G have finished, the rest are cancelled at once,
which aborts their generation calls on the generators and closes their environments. When so
many fail that G can no longer be reached, the group fails and the trainer re-issues it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from rollart.protocol.messages import GroupDone, GroupFailed, GroupTask, Trajectory

log = structlog.get_logger("rollart.rollout.group")


async def run_group(task: GroupTask, run_one: Callable[[str], Awaitable[Trajectory]]) -> GroupDone | GroupFailed:
    """Run `group_size + redundancy` trajectories and keep the first `group_size` to finish."""
    need = task.group_size
    tids = [f"{task.group_id}.{i}" for i in range(task.group_size + task.redundancy)]
    ids = {asyncio.ensure_future(run_one(tid)): tid for tid in tids}
    pending = set(ids)
    done: list[Trajectory] = []
    failures: list[str] = []
    try:
        while pending and len(done) < need and len(done) + len(pending) >= need:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
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
        why = f"a redundant extra: the group had its {need} trajectories" if len(done) >= need else "the group failed"
        for future in pending:
            future.cancel(why)  # the extras: generation aborted, environment closed (an agent told why)
        await asyncio.gather(*pending, return_exceptions=True)
    if len(done) >= need:
        return GroupDone(task.group_id, done[:need], cancelled=len(pending), failed=len(failures))
    reasons = "; ".join(sorted(set(failures)))[:500]
    return GroupFailed(task.group_id, f"{len(done)} of {need} trajectories finished ({reasons})")
