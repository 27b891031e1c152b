"""A training rank process's side of its group, whatever the backend (fsdp2, megatron): how it joins, how it
serves the group's commands, and how it leaves with its node.

`rollart.training.ranks.group.RankGroup` starts one process per local rank at its backend's entry point
(`RankMain`: `rollart.training.fsdp.rank.rank_main`, `rollart.training.megatron.rank.rank_main`), with
`RankArgs`. The entry calls `enter_group`, which starts watching the pipe to the node (a rank whose node died
exits at once rather than wait in a collective), joins the trainer's rendezvous store (never a generation it
joined in an earlier life: `join`) and the process group; then it serves commands with a `CommandLoop`: rank 0
reads each from its pipe to the trainer node and broadcasts it, so every rank runs the same collectives in the
same order, and rank 0 answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

if TYPE_CHECKING:
    from rollart.training.spec import TrainerSpec

REJOIN_S = 1.0
"""How often a rank that found only a broken group looks for the next one (`join`)."""


class CommandLoop:
    """A rank's side of the group's commands: rank 0 reads each from its pipe to the trainer node and broadcasts
    it; every rank runs `do_<name>(call, *args)` and rank 0 sends the result back (the fsdp2 and megatron ranks)."""

    _commands: Connection | None = None
    _send_lock: threading.Lock

    def serve(self, commands: Connection | None) -> None:
        self._commands, self._send_lock = commands, threading.Lock()
        while True:
            box: list[Any] = [commands.recv() if commands is not None else None]
            dist.broadcast_object_list(box, src=0)
            name, call, *args = box[0]
            if name == "stop":
                self.before_stop()
                return
            try:
                result = getattr(self, f"do_{name}")(call, *args)
            except Exception:  # the node raises it in the caller; the group may be broken
                self._reply(call, "error", traceback.format_exc())
                raise
            self._reply(call, "result", result)

    def before_stop(self) -> None:
        """What a rank finishes before the group stops (a background checkpoint write)."""

    def _reply(self, call: int, kind: str, payload: Any) -> None:
        if self._commands is not None:
            with self._send_lock:
                self._commands.send((call, kind, payload))


@dataclasses.dataclass(frozen=True)
class RankArgs:
    """What a rank process starts from (pickled to it)."""

    rank: int
    local_rank: int
    """Its index on its node: its GPU there."""
    world_size: int
    store: tuple[str, int]
    """The rendezvous store's host and port."""
    spec: TrainerSpec
    model_path: str
    seed: int


def join(args: RankArgs, timeout: timedelta) -> tuple[TCPStore, str]:
    """Connect to the rendezvous store and claim this rank's place in the generation it serves.

    A place claimed already means an earlier life of this rank joined that generation: the group
    broke (this rank's node died and was restarted) and the primary serving it is about to fail as
    well. Joining it would wait on ranks that never answer, so wait instead for the primary's next
    life and its fresh generation, on a new store (reconnecting once the old one is gone); a member
    may well start before its primary. Raises TimeoutError after `timeout` in all."""
    host, port = args.store
    deadline = time.monotonic() + timeout.total_seconds()
    while (left := deadline - time.monotonic()) > 0:
        try:
            client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=left))
            generation = client.get("generation").decode()
            if client.add(f"joined/{generation}/{args.rank}", 1) == 1:
                return client, generation
        except dist.DistNetworkError:
            pass  # no store there (yet, or any more): the primary is starting or going away
        time.sleep(min(REJOIN_S, max(0.0, deadline - time.monotonic())))
    raise TimeoutError(f"rank {args.rank} found no new group at {host}:{port} within {timeout.total_seconds():g} s")


def exit_with_node(alive: Connection) -> None:
    """Block until the node's end of the pipe closes (the node exited or stopped us), then exit."""
    with contextlib.suppress(EOFError, OSError):
        alive.recv()
    os._exit(3)


RankMain = Callable[[RankArgs, Connection | None, Connection], None]
"""A backend's rank process entry: (its start, rank 0's command pipe or None, the pipe that closes with the node)."""


def enter_group(args: RankArgs, device: torch.device, alive: Connection) -> None:
    """Leave with the node (`exit_with_node`, on a thread), then join the rendezvous and the process group
    (NCCL on GPUs, gloo on CPU) as rank `args.rank` of `args.world_size`."""
    threading.Thread(target=exit_with_node, args=(alive,), daemon=True).start()
    timeout = timedelta(seconds=args.spec.rank_timeout_s)
    client, generation = join(args, timeout)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=PrefixStore(f"rollart/{generation}/", client),
        rank=args.rank,
        world_size=args.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def leave_group() -> None:
    """Leave the process group on the way out (a rank whose group broke may fail to; it exits anyway)."""
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
