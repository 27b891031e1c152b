"""A member of a trainer group: a trainer node that runs more ranks of the primary's trainer, and nothing else.

A trainer that spans hosts is a group of trainer nodes (`rollart.topology.trainers`). The primary,
the run's trainer node (`rollart.nodes.trainer`), owns the dispenser, the sample buffer, the
sessions, the policy version and rank 0, and drives every rank of the group. A member
(`primary: NAME` in the topology) starts its `run.trainer.ranks` rank processes
(`rollart.training.ranks.group.RankGroup`, with no command pipe: its ranks take their commands from
rank 0's broadcasts), which find the others through the rendezvous store the primary serves, and
then only watches them. It opens no session and none is opened to it; its admin endpoint shows its
ranks (`/status` `ranks`: rank -> pid).

Its life follows its ranks'. When the primary stops them cleanly (rank 0 broadcasts `stop`) they
exit 0, and the member drains and exits 0. When one exits otherwise (it failed, or the group broke
because a rank elsewhere died) the member fails and exits 1, and its restart policy starts it again
with fresh ranks, which join the group of the primary's next life (the store's generation key keeps
them apart from the last one). Drained itself (SIGTERM, `POST /drain`), it waits for the primary to
stop its ranks until shortly before the drain timeout (a run that stops drains every node, and the
primary checkpoints with every rank before it stops them), then stops them itself, which breaks the
group: drain a member alone only to stop the whole trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import structlog

from rollart.errors import RollartError
from rollart.nodes.base import NodeDaemon
from rollart.topology.roles import Role
from rollart.training.registry import backend as training_backend

if TYPE_CHECKING:
    from rollart.training.ranks.group import RankGroup

log = structlog.get_logger("rollart.trainer_member")

STOP_RANKS_S = 1.0
"""What a draining member keeps of its drain timeout to stop its ranks itself (closing their pipes
ends them at once)."""


class TrainerMemberNode(NodeDaemon):
    """Runs this node's ranks of the primary trainer's group (module docstring)."""

    role = Role.TRAINER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout = self.topology.rank_layout(self.spec.name)
        self.group: RankGroup | None = None
        self.rank_exit: tuple[int, int | None] | None = None
        """The first of its ranks to exit: (rank, exit code)."""
        self._ranks_exited = asyncio.Event()

    async def work(self) -> None:
        run = self.topology.run
        if run.rollout is None or run.rollout.mode != "train":
            await super().work()  # the primary trains nothing: there are no ranks to run
            return
        from rollart.training.ranks.group import RankGroup  # torch, only on a member that trains

        entry = training_backend(run.trainer.backend).rank_main
        if entry is None:  # the topology check refuses a group of nodes for such a backend
            raise RollartError(f"run.trainer.backend: {run.trainer.backend} trains in no rank processes")
        self.group = await asyncio.to_thread(
            RankGroup,
            run.trainer,
            str(run.model.path),
            seed=run.rollout.seed,
            layout=self.layout,
            primary=False,
            entry=entry(),
        )
        rank, code = self.rank_exit = await asyncio.to_thread(self.group.wait_exit)
        self._ranks_exited.set()
        log.info("trainer_member.rank_exited", rank=rank, code=code)
        if code != 0:
            await asyncio.to_thread(self.group.close, 0.0)  # the group is broken: the others go too
            raise RollartError(f"rank {rank} exited with code {code}: the trainer group is broken")
        self.request_drain(f"rank {rank} exited 0: the primary trainer stopped its ranks")
        await super().work()

    async def drain_work(self) -> None:
        if self.group is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, self.topology.run.drain_timeout_s - STOP_RANKS_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ranks_exited.wait(), deadline - loop.time())
        if not self._ranks_exited.is_set():
            log.warning("trainer_member.stopping_ranks", why="the primary did not stop them in the drain timeout")
        # Ranks still finishing (a checkpoint write after the stop) get what is left; then they are stopped.
        await asyncio.to_thread(self.group.close, max(0.0, deadline - loop.time()))

    def progress(self) -> str:
        layout = self.layout
        last = layout.first_rank + layout.local_ranks - 1
        return f"ranks {layout.first_rank}-{last} of {layout.world_size} (primary {self.spec.primary})"

    def status(self) -> dict[str, Any]:
        status = super().status()
        status["primary"] = self.spec.primary
        status["world_size"] = self.layout.world_size
        status["ranks"] = {str(rank): p.pid for rank, p in self.group.processes.items()} if self.group else {}
        status["rank_exit"] = (
            None if self.rank_exit is None else dict(zip(("rank", "code"), self.rank_exit, strict=True))
        )
        return status
