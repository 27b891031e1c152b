"""The dispenser: which group each env-host runs next, and admission control for alpha.

It draws tasks by the mix's weights and gives each group a fresh environment seed. A grant is
a lease: the group is in flight until its env-host returns it (accepted or not), reports it
failed, or the lease expires; a failed, expired or refused group is re-issued (same task and
seed, new group id), so dropped work always gives its capacity back. A seed whose group has
failed on its last of `group_attempts` tries is given up (counted in `abandoned`) and the next
grant draws a fresh one: a task instance that breaks its env every time cannot hold a slot forever.

Admission (AReaL's rule, in groups): new work starts only while
    in flight + buffered < (alpha + 1) * batch_groups,
so the trainer never has more than alpha batches of work beyond the one it is waiting for, and
staleness is bounded mostly by not starting work rather than by discarding it. While the trainer
trains on a batch it has taken (`training`), the next batch is taken a version later, so work started now can fill one
batch fewer before it goes stale: the limit is then alpha batches (none at alpha 0). Counting (alpha + 1) batches there
too let a batch's worth of groups start that could only be dropped (docs/training.md, "Schedules", has what that cost);
the trainer also drops and aborts, when it takes a batch, the work that the version this batch makes will leave too old
(`PolicyVersions.foresee`), so its room is not held either.

With `lookahead: adaptive` the alpha in that rule is `ahead`, which `pace` moves as batches are taken: one up (to
alpha at most) whenever the trainer had to wait for a batch, one down (to 0) after `SHED_AFTER`
batches in a row that were complete already. A trainer that finds its batches ready is the
slower side: with alpha batches ahead the buffer holds alpha + 1 complete batches when the trainer
asks, each generated before the last alpha versions came out, so every trajectory of a one-turn
task would be alpha versions old when trained; with none ahead the next batch is generated while
the trainer trains on this one, one version old. One batch at a time, and down only after several
ready in a row: a batch can be complete when asked for in a run that rollout paces too (groups
finish in bursts), and shedding work ahead on every such batch left the trainer waiting. The
staleness bound itself stays alpha: a long episode started while rollout was the slower side is
still kept.

An adaptive run starts with one batch ahead (`START_AHEAD`), not alpha: at the start nothing is in
flight, and alpha + 1 batches started at once share the generators, so the first batch, which the
trainer waits for, comes as late as all of them. From one ahead, the first wait of the trainer adds
the next. What each of these choices measured is in docs/training.md, "Schedules".
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from rollart.protocol.messages import GroupTask
from rollart.rollout.config import RolloutSpec

log = structlog.get_logger("rollart.rollout.dispenser")

SHED_AFTER = 3
"""`lookahead: adaptive`: batches in a row found complete before one fewer is started ahead."""
START_AHEAD = 1
"""`lookahead: adaptive`: batches ahead at the start (alpha when it is smaller)."""


@dataclass
class Lease:
    """A group in flight."""

    task: GroupTask
    env_host: str
    granted_at: float
    attempt: int


class Dispenser:
    """Hands out group tasks within the admission limit."""

    def __init__(self, spec: RolloutSpec, *, buffered: Callable[[], int], clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.buffered = buffered
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self._paused = False
        self._held = False
        self._done = False
        self._training = False
        self.incarnation = 0
        """Which life of the trainer this is (one more than its checkpoint's; the trainer makes it the
        count of its starts, `Learner.claim_incarnation`): part of group ids after a restart, so a
        group still in flight from before the restart can never be taken for a new one."""
        self._rng = random.Random(spec.seed)
        self._weights = [task.weight for task in spec.tasks]
        self._next_group = 0
        self._next_seed = spec.seed * 1_000_003
        self._retry: collections.deque[tuple[str, int, int]] = collections.deque()  # (task, seed, attempt)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        """Grants waiting for room, oldest first."""
        self.granted = self.completed = self.reissued = self.abandoned = 0
        """Grants, and how each lease ended: granted = completed + reissued + abandoned + in flight."""
        self.requeued = 0
        """Groups completed, then dropped from the buffer as stale and put back in line."""
        self.abandoned_seeds: list[int] = []
        """The seeds given up, so a run's records account for every seed drawn."""
        self.ahead = min(spec.alpha, START_AHEAD) if spec.lookahead == "adaptive" else spec.alpha
        """Batches of work admitted beyond the one the trainer waits for (`pace`)."""
        self.other_work: Callable[[], bool] = lambda: False
        """Whether work outside admission waits to be handed out (held-out evaluation): a grant waiting for
        room returns None at once, so its env-host's request can take that work."""
        self._ready_in_a_row = 0

    # -- what admission depends on: each change wakes the grants waiting for room -------------------

    @property
    def paused(self) -> bool:
        """Paused by an operator (admin /pause)."""
        return self._paused

    @property
    def held(self) -> bool:
        """Held by the trainer (before its weights are ready; the synchronous baseline, while it trains and
        pushes weights; at the end, while the last evaluation runs)."""
        return self._held

    @property
    def done(self) -> bool:
        """The last batch is taken: nothing more is granted, and every waiting grant is told so."""
        return self._done

    @property
    def training(self) -> bool:
        """The trainer has taken a batch whose version is not out yet: the next batch comes a version later."""
        return self._training

    def pause(self) -> None:
        self._paused = True

    def unpause(self) -> None:
        self._paused = False
        self.changed()

    def hold(self, held: bool = True) -> None:
        """Hold grants (`held` False: release them, as `release` does)."""
        self._held = held
        if not held:
            self.changed()

    def release(self) -> None:
        self.hold(False)

    def finish(self) -> None:
        self._done = True
        self.changed()

    def set_training(self, training: bool) -> None:
        """A batch was taken whose step makes the next version (True), or that version is out (False)."""
        self._training = training
        self.changed()

    @property
    def limit(self) -> int:
        """Groups that may be in flight or buffered: the batches that work started now can still fill."""
        batches = self.ahead + 1
        if self.training:  # batches up to version + alpha, the next one of which is taken at version + 1
            batches = min(self.ahead, self.spec.alpha - 1) + 1
        return batches * self.spec.batch_groups

    def pace(self, *, batch_was_ready: bool) -> None:
        """The trainer took a batch: it was complete before the trainer asked, or the trainer waited."""
        if self.spec.lookahead != "adaptive":
            return
        ahead = self.ahead
        if not batch_was_ready:
            ahead, self._ready_in_a_row = min(self.spec.alpha, ahead + 1), 0
        else:
            self._ready_in_a_row += 1
            if self._ready_in_a_row >= SHED_AFTER:
                ahead, self._ready_in_a_row = max(0, ahead - 1), 0
        if ahead != self.ahead:
            log.info("dispenser.lookahead", ahead=ahead, batch_was_ready=batch_was_ready)
            grew, self.ahead = ahead > self.ahead, ahead
            if grew:  # more room: wake the grants waiting for it
                self.changed()

    def room(self) -> int:
        """How many groups may be granted now."""
        if self.done or self.paused or self.held:
            return 0
        return max(0, self.limit - len(self.leases) - self.buffered())

    def admissible(self) -> bool:
        return self.room() > 0

    def wake_all(self) -> None:
        """Wake every waiting grant (other work came: each looks at `other_work` again)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def changed(self) -> None:
        """Something that admission depends on changed (a batch taken, a pause lifted, a group back):
        wake the oldest waiting grants, as many as there is room for (or all of them once the run is
        done, to be told so). Waking every waiter on every change made each change cost O(waiters),
        quadratic in the cluster once thousands of env-host slots wait."""
        room = len(self._waiters) if self.done else self.room()
        while room > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1

    async def grant(self, env_host: str, version: int | Callable[[], int], *, wait_s: float) -> GroupTask | None:
        """A group for `env_host`, waiting up to `wait_s` for room; None when there is none. The
        task carries `version` (called once room is found, when it is a function: a batch taken
        while the grant waited may have moved the policy on)."""
        try:
            async with asyncio.timeout(wait_s):
                while not self.admissible():
                    if self.done or self.other_work():  # nothing more will be granted, or other work waits
                        return None
                    waiter = asyncio.get_running_loop().create_future()
                    self._waiters.append(waiter)
                    try:
                        await waiter
                    finally:
                        if not waiter.done():  # timed out or cancelled: leave the line
                            waiter.cancel()
        except TimeoutError:
            self.changed()  # a wake-up this grant may have been given passes to the next in line
            return None
        if self._retry:
            task_name, seed, attempt = self._retry.popleft()
        else:
            task_name = self._rng.choices(self.spec.tasks, weights=self._weights)[0].name
            self._next_seed += 1
            seed, attempt = self._next_seed, 0
        self._next_group += 1
        prefix = f"i{self.incarnation}." if self.incarnation else ""
        task = GroupTask(
            group_id=f"{prefix}g{self._next_group}" + (f"-r{attempt}" if attempt else ""),
            task=task_name,
            seed=seed,
            group_size=self.spec.group_size,
            redundancy=self.spec.redundancy,
            version=version() if callable(version) else version,
            min_size=self.spec.min_group_size or 0,
        )
        self.leases[task.group_id] = Lease(task, env_host, self.clock(), attempt)
        self.granted += 1
        return task

    def complete(self, group_id: str) -> Lease | None:
        """The group came back; None when it was not in flight (expired and re-issued already)."""
        lease = self.leases.pop(group_id, None)
        if lease is not None:
            self.completed += 1
            self.changed()
        return lease

    def reissue(self, group_id: str, reason: str, *, failed: bool = False) -> None:
        """Put the group's task and seed back in line (failed, refused as stale, or lost); a `failed`
        group on its last try gives its seed up instead."""
        lease = self.leases.pop(group_id, None)
        if lease is None:
            return
        if failed and lease.attempt + 1 >= self.spec.group_attempts:
            self.abandoned += 1
            self.abandoned_seeds.append(lease.task.seed)
            log.warning(
                "dispenser.seed_abandoned", group=group_id, task=lease.task.task, seed=lease.task.seed, reason=reason
            )
            self.changed()
            return
        self._retry.append((lease.task.task, lease.task.seed, lease.attempt + 1))
        self.reissued += 1
        log.info("dispenser.reissue", group=group_id, reason=reason, env_host=lease.env_host)
        self.changed()

    def requeue(self, task: str, seed: int, reason: str) -> None:
        """Run a task and seed again that came back but cannot be used (dropped as stale)."""
        self._retry.append((task, seed, 1))
        self.requeued += 1
        log.info("dispenser.requeue", task=task, seed=seed, reason=reason)
        self.changed()

    def release_env_host(self, env_host: str, reason: str) -> None:
        """Re-issue every group an env-host holds (it restarted, or is gone)."""
        for group_id, lease in list(self.leases.items()):
            if lease.env_host == env_host:
                self.reissue(group_id, reason)

    def expire(self) -> None:
        """Re-issue groups held longer than `group_timeout_s`."""
        now = self.clock()
        for group_id, lease in list(self.leases.items()):
            if now - lease.granted_at > self.spec.group_timeout_s:
                self.reissue(group_id, f"not returned within {self.spec.group_timeout_s} s")

    def state_dict(self, buffered: list[tuple[str, int]]) -> dict[str, Any]:
        """What a checkpoint keeps: the draw's RNG, counters, and every group not trained on yet (in
        flight, or `buffered` (task, seed) pairs), to be run again after a restart with the same seed."""
        retry = [*self._retry, *((task, seed, 1) for task, seed in buffered)]
        retry += [(lease.task.task, lease.task.seed, lease.attempt + 1) for lease in self.leases.values()]
        return {
            "rng": self._rng.getstate(),
            "next_group": self._next_group,
            "next_seed": self._next_seed,
            "retry": retry,
            "incarnation": self.incarnation,
            "counts": [self.granted, self.completed, self.reissued],
            "abandoned": self.abandoned,
            "abandoned_seeds": self.abandoned_seeds,
            "requeued": self.requeued,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` as the next incarnation."""
        self._rng.setstate(state["rng"])
        self._next_group = state["next_group"]
        self._next_seed = state["next_seed"]
        self._retry = collections.deque((task, seed, attempt) for task, seed, attempt in state["retry"])
        self.incarnation = state["incarnation"] + 1
        self.granted, self.completed, self.reissued = state["counts"]
        # absent from checkpoints made before they were counted apart
        self.abandoned, self.requeued = state.get("abandoned", 0), state.get("requeued", 0)
        self.abandoned_seeds = list(state.get("abandoned_seeds", []))

    def stats(self) -> dict[str, int]:
        return {
            "in_flight": len(self.leases),
            "limit": self.limit,
            "granted": self.granted,
            "completed": self.completed,
            "reissued": self.reissued,
            "abandoned": self.abandoned,
            "requeued": self.requeued,
            "retry_queue": len(self._retry),
        }
