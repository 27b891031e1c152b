"""Weights by collective broadcast (`transport: nccl`): each bucket's bytes go once, from the trainer to every
generator of a push at the same time, over a process group of their own; the push, each bucket's manifest and
the acks still go over each generator's TCP connection, as on the TCP path (`rollart.weights.wire`).

    groups = Groups(host="10.0.0.1")                      # the trainer: where its groups meet (a TCPStore)
    group, tickets = groups.group_for(("gen-0", "gen-1"), timeout_s=60)
    ... send tickets[i] to member i in its Push ...
    await group.broadcast(bucket)                         # rank 0 sends

    group = Group.join(ticket)                            # a generator, told in a Push
    await group.broadcast(buffer)                         # receives into `buffer`

The group is NCCL where the trainer's process has CUDA (buckets go through a device buffer: host -> device,
broadcast, device -> host; every member then needs a GPU of its own, NCCL taking no two ranks on one device), gloo
otherwise, which is how it runs on CPU and how it is tested here. Its members are the
trainer (rank 0) and the generators of one push, in the order of their names. A group is kept while the same
generators take the pushes; a generator joining, restarting or dying makes a new one with a new key, as it
makes a new TCP connection on that path. Forming one costs a rendezvous (milliseconds with gloo, about a second
with NCCL), so pushes to an unchanging set of generators pay it once.

A broken group (a member that died mid-broadcast, a timeout) is never used again: every member's operations on
it fail, its members hang up, and the next push forms a new one without whoever is gone. Each group runs its
operations in a thread of its own, in order (joining first): a member stuck in a broken group's broadcast holds
that thread only, until the group's timeout.

What protects the bytes: the group itself is not authenticated (a TCPStore takes anyone who knows its key).
The key is random per group and travels over the authenticated connection, and every bucket is checked against
the CRC-32C its manifest announced, the manifest carrying a MAC keyed with the run's secret
(`wire.manifest_mac`). docs/security.md says what that does and does not stop.
"""

from __future__ import annotations

import asyncio
import datetime
import secrets
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import structlog
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from rollart.errors import RollartError
from rollart.weights.wire import GroupTicket

log = structlog.get_logger("rollart.weights.collective")


class GroupFailed(RollartError):
    """A collective group could not be formed or an operation on it failed; the group is not used again."""


def group_backend() -> str:
    """The backend the groups this process forms use: NCCL where CUDA is, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class Group:
    """One member's end of a weights group: broadcasts in order, in a thread of its own."""

    def __init__(self, ticket: GroupTicket, store: Any = None) -> None:
        """`store`: the trainer's TCPStore (the master); None: connect to the ticket's."""
        self.ticket = ticket
        self.broken = ""
        """Why it is not used again ('' while it works)."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"weights-group-{ticket.key[:8]}")
        self._pg: Any = None
        self._staging: torch.Tensor | None = None
        self._closed = False
        self._executor.submit(self._join, store)

    @classmethod
    def join(cls, ticket: GroupTicket) -> Group:
        """Join the group a push named (`Push.group`); the rendezvous completes in the group's thread."""
        if ticket.backend == "nccl" and not torch.cuda.is_available():
            raise GroupFailed(f"weights group {ticket.key[:8]} is NCCL, and this process sees no CUDA device")
        return cls(ticket)

    def _join(self, store: Any) -> None:
        ticket = self.ticket
        timeout = datetime.timedelta(seconds=ticket.timeout_s)
        try:
            if store is None:
                store = TCPStore(ticket.host, ticket.port, is_master=False, timeout=timeout)
            scoped = PrefixStore(f"rollart/{ticket.key}/", store)
            if ticket.backend == "nccl":
                self._pg = dist.ProcessGroupNCCL(scoped, ticket.rank, ticket.size, dist.ProcessGroupNCCL.Options())
            else:
                self._pg = dist.ProcessGroupGloo(scoped, ticket.rank, ticket.size, timeout)
        except Exception as exc:  # recorded: every later operation raises it
            self.broken = f"joining group {ticket.key[:8]} as rank {ticket.rank} of {ticket.size}: {exc}"

    async def broadcast(self, buffer: memoryview) -> None:
        """Rank 0: send `buffer` to every member; the others: receive into it. Raises `GroupFailed`."""
        if not len(buffer):
            tensor = torch.empty(0, dtype=torch.uint8)
        elif buffer.readonly:  # rank 0 sending an export's own memory: the broadcast only reads it
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
                tensor = torch.frombuffer(buffer, dtype=torch.uint8)
        else:
            tensor = torch.frombuffer(buffer, dtype=torch.uint8)
        try:
            await asyncio.wrap_future(self._executor.submit(self._broadcast, tensor))
        except GroupFailed:
            raise
        except Exception as exc:
            self.broken = self.broken or f"broadcast on group {self.ticket.key[:8]}: {exc}"
            raise GroupFailed(self.broken) from exc

    def _broadcast(self, host: torch.Tensor) -> None:
        if self.broken:
            raise GroupFailed(self.broken)
        if self.ticket.backend == "gloo":
            self._pg.broadcast(host, 0).wait()
            return
        n = host.numel()
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(n, dtype=torch.uint8, device="cuda")
        device = self._staging[:n]
        if self.ticket.rank == 0:
            device.copy_(host)
        self._pg.broadcast(device, 0).wait()
        if self.ticket.rank != 0:
            host.copy_(device)
        torch.cuda.current_stream().synchronize()

    def close(self, why: str = "closed") -> None:
        """Use it no more; its thread lets go of the process group (closing its connections, which ends the
        other members' pending operations) once the operation in progress, if any, has ended."""
        self.broken = self.broken or why
        if self._closed:
            return
        self._closed = True
        self._executor.submit(self._drop)
        self._executor.shutdown(wait=False)

    def _drop(self) -> None:
        pg, self._pg, self._staging = self._pg, None, None
        if pg is not None:
            pg.abort()


class Groups:
    """The trainer's groups: where they meet, and the one kept for each set of generators."""

    def __init__(self, host: str) -> None:
        """`host`: the address generators reach this process at (the TCPStore listens on every interface)."""
        self.host = host
        self.formed = 0
        """Groups formed so far (a new one per change of members)."""
        self._store: Any = None
        self._groups: dict[tuple[str, ...], Group] = {}

    def group_for(self, members: tuple[str, ...], *, timeout_s: float) -> tuple[Group, list[GroupTicket]]:
        """The group of the trainer and `members` (rank i+1 is members[i]), formed anew unless a working one has
        the same members; one member's ticket each. Groups that share a member with a new one are closed."""
        group = self._groups.get(members)
        if group is not None and not group.broken:
            return group, [_for_rank(group.ticket, rank) for rank in range(1, len(members) + 1)]
        if self._store is None:
            self._store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        for others in [key for key in self._groups if set(key) & set(members)]:
            self._groups.pop(others).close("a group of other members replaced it")
        backend = group_backend()
        size = len(members) + 1
        ticket = GroupTicket(secrets.token_hex(16), self.host, self._store.port, 0, size, backend, timeout_s)
        group = Group(ticket, self._store)
        self._groups[members] = group
        self.formed += 1
        log.info("weights.group_formed", key=ticket.key[:8], members=list(members), backend=backend)
        return group, [_for_rank(ticket, rank) for rank in range(1, len(members) + 1)]

    def discard(self, group: Group, why: str) -> None:
        for key in [key for key, kept in self._groups.items() if kept is group]:
            del self._groups[key]
        group.close(why)

    def close(self) -> None:
        for group in self._groups.values():
            group.close()
        self._groups.clear()
        self._store = None


def _for_rank(ticket: GroupTicket, rank: int) -> GroupTicket:
    return msgspec.structs.replace(ticket, rank=rank)
