"""A trainer node's rank processes (fsdp2, megatron): starting them, the rendezvous, and calls to rank 0.

A trainer node runs `layout.local_ranks` rank processes at its backend's entry point (`TrainingBackend.rank_main`:
`rollart.training.fsdp.rank.rank_main`, `rollart.training.megatron.rank.rank_main`),
ranks `first_rank` to `first_rank + local_ranks - 1` of `world_size`. The primary trainer node also
serves the rendezvous: a `torch.distributed.TCPStore` every rank joins the process group through
(the store's port is `layout.store_port`; 0 picks a free one, enough when all ranks are local).
The store carries a generation key, fresh for every primary process, so ranks of a previous life
never meet the new ones' keys.

Only the primary talks to ranks, and only to rank 0 (`call`): a command goes down rank 0's pipe,
rank 0 broadcasts it, rank 0 answers. A reader thread routes answers to their callers and watches
every local rank's process: when one exits, every waiting call fails with `RankDied`, and so does
every later one, and so does the group's `failed` future, which the trainer node watches between
calls. The group does not heal itself: the trainer node fails, its restart policy starts it again,
and the new group resumes from the last checkpoint (a member node likewise exits when one
of its ranks dies, or when its ranks leave because a rank elsewhere died).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import uuid
from concurrent.futures import Future, InvalidStateError
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import structlog
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from rollart.errors import RollartError
from rollart.training.ranks.process import RankArgs, RankMain

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from rollart.training.spec import RankLayout, TrainerSpec

log = structlog.get_logger("rollart.ranks")


class RankDied(RollartError):
    """A rank process exited (or a call failed in a rank); the group is no longer usable."""


class RankGroup:
    """This node's rank processes (module docstring)."""

    def __init__(
        self, spec: TrainerSpec, model_path: str, *, seed: int, layout: RankLayout, primary: bool, entry: RankMain
    ) -> None:
        """`entry` is the backend's rank process (`TrainingBackend.rank_main`)."""
        self.layout = layout
        self.store: TCPStore | None = None
        timeout = timedelta(seconds=spec.rank_timeout_s)
        host, port = layout.store_host, layout.store_port
        if primary:
            self.store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
            self.store.set("generation", uuid.uuid4().hex)
            port = self.store.port
        context = mp.get_context("spawn")
        self.processes: dict[int, BaseProcess] = {}
        self._alive: list[Connection] = []
        self.commands: Connection | None = None
        for rank in range(layout.first_rank, layout.first_rank + layout.local_ranks):
            theirs, ours = context.Pipe(duplex=False)
            commands = None
            if rank == 0:
                self.commands, commands = context.Pipe()
            args = RankArgs(rank, rank - layout.first_rank, layout.world_size, (host, port), spec, model_path, seed)
            process = context.Process(
                target=entry, args=(args, commands, theirs), name=f"rollart-rank{rank}", daemon=True
            )
            process.start()
            theirs.close()
            if commands is not None:
                commands.close()
            self._alive.append(ours)
            self.processes[rank] = process
        log.info(
            "ranks.started",
            ranks=sorted(self.processes),
            world_size=layout.world_size,
            pids=[p.pid for p in self.processes.values()],
            store=f"{host}:{port}",
        )
        self._ids = itertools.count()
        self._calls: dict[int, queue.Queue[tuple[str, Any]]] = {}
        self._later: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self.broken: str | None = None
        self.failed: Future[None] = Future()
        """Fails with `RankDied` when the group breaks (not when it is closed); never completes
        otherwise. Running from the start, so a waiter that gives up cannot cancel it."""
        self.failed.set_running_or_notify_cancel()
        self.first_exit: tuple[int, int | None] | None = None
        """The first of this node's ranks to exit, and its exit code (the reader sets it)."""
        self._exited = threading.Event()
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="rank-group", daemon=True)
        self._reader.start()

    # -- watching and reading ---------------------------------------------------------------------

    def _read(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in self.processes.items()}
        while True:
            ready = wait([*([self.commands] if self.commands is not None else []), *sentinels])
            for source in ready:
                if source is self.commands:
                    try:
                        call, kind, payload = self.commands.recv()
                    except EOFError:
                        continue  # rank 0 exited: its sentinel says so
                    except OSError as e:
                        # A message came but not what it holds: tensors travel as shared memory whose
                        # handle is fetched from the sender, and a rank 0 killed after sending cannot
                        # give it. Its answer is lost: the group cannot go on.
                        self._fail(f"a message from rank 0 was lost ({type(e).__name__}: {e})")
                        continue
                    self._route(call, kind, payload)
                else:
                    rank = sentinels[source]  # type: ignore[index]
                    process = self.processes[rank]
                    self.first_exit = rank, exit_code(process)
                    # A member's ranks exit 0 when the primary stops them: not a failure to report.
                    clean = self.commands is None and process.exitcode == 0
                    self._fail(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}", quiet=clean)
                    self._exited.set()
                    return

    def _route(self, call: int, kind: str, payload: Any) -> None:
        with self._lock:
            later = self._later.get(call)
            waiting = self._calls.get(call)
        if kind == "saved" and later is not None:
            self._later.pop(call, None)
            later.set_result(None)
        elif kind == "error" and waiting is None and later is not None:
            self._later.pop(call, None)
            later.set_exception(RankDied(f"a background checkpoint write failed: {payload}"))
        elif waiting is not None:
            waiting.put((kind, payload))

    def _fail(self, reason: str, *, quiet: bool = False) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = reason
            calls, self._calls = list(self._calls.values()), {}
            later, self._later = list(self._later.values()), {}
        if not self._closing and not quiet:
            log.error("ranks.group_failed", reason=reason)
            with contextlib.suppress(InvalidStateError):  # it failed already
                self.failed.set_exception(RankDied(reason))
        for waiting in calls:
            waiting.put(("dead", reason))
        for future in later:
            future.set_exception(RankDied(reason))

    def wait_exit(self) -> tuple[int, int | None]:
        """Block until one of this node's ranks exits: (rank, exit code). For member nodes."""
        self._exited.wait()
        assert self.first_exit is not None  # set before the event
        return self.first_exit

    # -- calling rank 0 ---------------------------------------------------------------------------

    def call(self, name: str, *args: Any, later: Future[None] | None = None) -> Any:
        """Run command `name` on every rank and return rank 0's answer; `later` completes with a second answer
        (a background write)."""
        call, answers = self._send(name, args, later)
        return self._answer(name, call, answers)

    def submit(self, name: str, *args: Any) -> Future[Any]:
        """Send command `name` now and return the future of rank 0's answer. The ranks run commands in the order
        they are sent, so one sent after this (the next `train`) runs after it, whoever waits for what."""
        call, answers = self._send(name, args, None)
        answered: Future[Any] = Future()
        answered.set_running_or_notify_cancel()  # a waiter that gives up must not cancel it under the group

        def wait() -> None:
            try:
                answered.set_result(self._answer(name, call, answers))
            except BaseException as error:  # handed to whoever waits on the future
                answered.set_exception(error)

        threading.Thread(target=wait, name=f"rank-answer-{name}-{call}", daemon=True).start()
        return answered

    def _send(self, name: str, args: tuple[Any, ...], later: Future[None] | None) -> tuple[int, queue.Queue[Any]]:
        if self.commands is None:
            raise RollartError("only the primary trainer node's rank group takes commands")
        answers: queue.Queue[tuple[str, Any]] = queue.Queue()
        with self._lock:
            if self.broken is not None:
                raise RankDied(f"the rank group failed earlier: {self.broken}")
            call = next(self._ids)
            self._calls[call] = answers
            if later is not None:
                self._later[call] = later
            try:
                self.commands.send((name, call, *args))
            except OSError as error:  # rank 0 is gone; its exit may not have been seen yet
                self._calls.pop(call, None)
                self._later.pop(call, None)
                raise RankDied(f"{name}: rank 0's pipe is closed ({error})") from None
        return call, answers

    def _answer(self, name: str, call: int, answers: queue.Queue[Any]) -> Any:
        try:
            while True:
                kind, payload = answers.get()
                if kind == "result":
                    return payload
                elif kind == "dead":
                    raise RankDied(f"{name} failed: {payload}")
                elif kind == "error":
                    self._fail(f"{name} raised in rank 0")
                    raise RankDied(f"{name} raised in rank 0:\n{payload}")
        finally:
            with self._lock:
                self._calls.pop(call, None)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the ranks: a clean `stop` while the group works (they finish the checkpoint being
        written, for up to `timeout`); then close their pipes, and kill what is left."""
        self._closing = True
        if self.broken is None:  # a broken group cannot stop cleanly: its ranks would wait for the dead one
            if self.commands is not None:
                with contextlib.suppress(Exception), self._lock:
                    self.commands.send(("stop", -1))
            for process in self.processes.values():
                process.join(timeout)
        for pipe in self._alive:
            pipe.close()  # a rank still alive sees its node leave and exits
        for process in self.processes.values():
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()


def exit_code(process: BaseProcess) -> int | None:
    """The exit code of a rank whose sentinel is ready. Two threads may reap it at once (the reader
    and `close`): the one that loses the race sees no code until the other has stored it."""
    for _ in range(100):
        process.join(0.01)
        if process.exitcode is not None:
            break
    return process.exitcode
