"""The env-host's rollout as it stands, in one owner: the policy version it knows, its counts, the
trajectories in flight and the `LLMProxy` their turns go through.

The version rises with every grant and every `PolicyVersion` notice from the trainer, and never falls.
A trajectory is live from the moment its coroutine starts (before its env is made) until it ends; it is
running from its first generation call, with the version it started at. When the trainer announces a
version trained from start version `min_start` on, every running trajectory that started before it is
aborted here at once (an evaluation's are never: they measure the policy they name); when it says the
run is over, every live one is. The node (`rollart.nodes.env_host`) and its mode
(`rollart.nodes.env_host_modes`) read and change this state only through this object.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from rollart.envs import EnvFailure
from rollart.errors import RollartError
from rollart.protocol.messages import GroupTask
from rollart.rollout.proxy import LLMProxy
from rollart.rollout.staleness import StalenessBound

log = structlog.get_logger("rollart.env_host")

ENV_HOST_COUNTS = {
    "groups_done": "Groups run to the end (G trajectories reached)",
    "groups_failed": "Groups that could not reach G trajectories",
    "groups_accepted": "Groups the trainer took into its buffer",
    "groups_refused": "Groups the trainer refused (stale)",
    "groups_undelivered": "Groups that could not be handed in",
    "trajectories_done": "Trajectories finished",
    "trajectories_failed": "Trajectories that failed (environment or generation)",
    "aborted_stale": "Trajectories aborted while running: a new version made them too stale",
    "cancelled_extras": "Redundant trajectories cancelled once their group had G",
    "env_failures": "Environment resets or steps that raised or timed out",
}
"""The env-host's counts exported as metrics (`rollart_env_host_<key>_total`); `counts` has a few more
(`envs_opened`, `envs_closed`, `adaptive_extras`), shown in its status and summary."""


class RolloutState:
    """What an env-host's rollout knows and has done so far."""

    def __init__(self, proxy: LLMProxy, bound: StalenessBound, *, train: bool) -> None:
        """`train`: versions mean weights (`rollout.mode: train`); rollout-only runs bump them with no push."""
        self.proxy = proxy
        self.bound = bound
        self.train = train
        self.version = 0
        """The newest policy version the trainer has told of (in a grant or a notice)."""
        self.counts: collections.Counter[str] = collections.Counter()
        self.live: dict[str, asyncio.Task[Any]] = {}
        """Every trajectory task, from before its env is made (all are cancelled when the run is over)."""
        self.running: dict[str, tuple[asyncio.Task[Any], int]] = {}
        """Trajectories that have generated, with the version they started at (for stale aborts)."""
        self.run_done = False
        """The trainer said the run is over (`PolicyVersion.done`)."""

    def over(self) -> bool:
        """Whether the trainer said the run is done (read through a call: it changes across awaits)."""
        return self.run_done

    def current_version(self) -> int:
        return self.version

    # -- what the trainer says -----------------------------------------------------------------------

    def saw_version(self, version: int) -> None:
        """A grant or notice named `version`: the known version rises to it (a late, older one changes nothing)."""
        self.version = max(self.version, version)

    def abort_stale(self, version: int, min_start: int) -> None:
        """`version` trains from start version `min_start` on: abort every running trajectory started before."""
        for trajectory_id, (task, started) in list(self.running.items()):
            if started < min_start:
                task.cancel(f"too stale: started at version {started}, trained from version {min_start} on")
                self.counts["aborted_stale"] += 1
                log.info("env_host.abort_stale", trajectory=trajectory_id, started=started, version=version)

    def run_over(self) -> None:
        """The trainer has what it needs: what is in flight can never be used."""
        self.run_done = True
        for task in list(self.live.values()):
            task.cancel("the run is over")
        log.info("env_host.run_done", aborted=len(self.live))

    # -- one trajectory ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def playing(self, trajectory_id: str) -> Iterator[None]:
        """Track the current task as trajectory `trajectory_id` while the block runs, and count how it ends."""
        task = asyncio.current_task()
        assert task is not None
        self.live[trajectory_id] = task
        try:
            yield
        except EnvFailure:
            self.counts["env_failures"] += 1
            self.counts["trajectories_failed"] += 1
            raise
        except RollartError:
            self.counts["trajectories_failed"] += 1
            raise
        finally:
            self.running.pop(trajectory_id, None)
            self.live.pop(trajectory_id, None)
        self.counts["trajectories_done"] += 1

    def on_start(self, trajectory_id: str, group: GroupTask) -> Callable[[int], None]:
        """What to call when the trajectory first generates: from then on it is aborted once too stale
        (an evaluation's never are)."""

        def started(version: int) -> None:
            task = self.live.get(trajectory_id)
            if task is not None and not group.evaluation:
                self.running[trajectory_id] = (task, version)

        return started

    def min_version(self, group: GroupTask) -> Callable[[], int]:
        """The oldest weights a turn of `group` may be served with, asked at each turn. An evaluation measures
        the policy it names: its calls wait for that version's weights where a generator is still behind (with
        the staleness bound they could sample from older ones). Without training, versions are not weights."""
        if not self.train:
            return lambda: 0
        if group.evaluation:
            return lambda: group.version
        return lambda: self.bound.oldest_weights(self.version)

    # -- what it shows ----------------------------------------------------------------------------------

    def progress(self) -> str:
        c = self.counts
        return f"trajectories {c['trajectories_done']} done, {c['trajectories_failed']} failed"

    def describe(self) -> dict[str, Any]:
        """The `rollout` part of the env-host's status: the version, the counts, the routing."""
        return {"version": self.version, **self.counts, "routing": self.proxy.describe()}

    def metrics(self) -> dict[str, tuple[str, float]]:
        """The exported counts (`ENV_HOST_COUNTS`) by metric name."""
        return {f"rollart_env_host_{key}": (doc, self.counts[key]) for key, doc in ENV_HOST_COUNTS.items()}
