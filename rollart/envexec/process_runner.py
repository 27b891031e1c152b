"""WorkerEnvRunner: one env that lives in an env worker process, with `EnvRunner`'s interface.

    runner = await pool.open("maze", {"size": 7}, timeout_s=10)    # EnvWorkerPool.open
    obs, info = await runner.reset(seed)
    obs, reward, terminated, truncated, info = await runner.step(reply)
    await runner.close()

The failure semantics are `EnvRunner`'s: everything that goes wrong comes out as `EnvFailure`
naming the env, the call and the cause (the env raised; the call ran past its deadline; the
worker died, and how; the runner is broken or closed), and `CancelledError` passes through.

The differences are where the env lives. A call past its deadline kills the worker process, so
the hung env stops for good; the runner is broken afterwards, as is every runner whose env lived
in that worker (see `rollart.envexec.pool` for that trade-off). A call whose caller was cancelled
goes on in the worker under the same deadline, enforced by the pool whether anyone waits or not.
The observation, reward and flags come back as `str`, `float` and `bool`; the info dict crosses
as msgpack (numbers, strings, lists, dicts; anything else as its `str`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from rollart.clock import SimClock
from rollart.envexec.runner import CLOSE_GRACE_S
from rollart.envexec.wire import Answer, Close, Closed, Failed, Made, Request, Reset, ResetDone, Step, StepDone
from rollart.envs.base import EnvFailure, Info, StepResult

if TYPE_CHECKING:
    from rollart.envexec.handles import EnvWorker
    from rollart.envexec.pool import EnvWorkerPool

Done = TypeVar("Done", ResetDone, StepDone)


@dataclass(frozen=True, slots=True)
class EnvSlot:
    """Where one env lives: its worker process in the pool, its id there, and its registered name."""

    pool: EnvWorkerPool
    worker: EnvWorker
    env_id: int
    name: str

    def submit(
        self, request: Callable[[int], Request], answer: type[Answer], *, timeout_s: float
    ) -> asyncio.Future[Answer | Failed]:
        """`EnvWorkerPool.submit` of a call to this env."""
        return self.pool.submit(self.worker, self.env_id, self.name, request, answer, timeout_s=timeout_s)

    def forget(self) -> None:
        """The env is gone: its worker stops counting it."""
        self.pool.forget(self.worker, self.env_id)


class WorkerEnvRunner:
    """Runs one env's `reset`/`step`/`close` in an env worker process under a per-call timeout."""

    def __init__(self, slot: EnvSlot, made: Made, *, timeout_s: float, clock: SimClock | None = None) -> None:
        self.slot = slot
        self.name = slot.name
        self.worker = slot.worker
        self.timeout_s = timeout_s
        self.clock = clock or SimClock()
        """Where an env's reported `wait_s` (simulated time) is waited out."""
        self.profile = made.profile
        self.max_turns = made.max_turns
        self.system_prompt = made.system_prompt
        self._broken: str | None = None
        self._closed = False
        self._running: asyncio.Future[Any] | None = None
        """The latest call sent (it may outlive a cancelled caller)."""

    @property
    def pid(self) -> int:
        """The process the env lives in."""
        return self.worker.pid

    @property
    def broken(self) -> bool:
        """Whether a call timed out or the env's worker died."""
        return self._broken is not None or self.worker.ended is not None

    @property
    def closed(self) -> bool:
        return self._closed

    async def reset(self, seed: int | None = None) -> tuple[str, Info]:
        reply = await self._call("reset", lambda call: Reset(call, self.slot.env_id, seed), ResetDone)
        return reply.obs, reply.info

    async def step(self, action: str) -> StepResult:
        reply = await self._call("step", lambda call: Step(call, self.slot.env_id, action), StepDone)
        return reply.obs, reply.reward, reply.terminated, reply.truncated, reply.info

    async def close(self) -> None:
        """`env.close()` in the worker (skipped if broken). Idempotent; a failure is raised once.

        A call still running for a cancelled caller goes first (the worker runs an env's calls in
        order); then the close is waited for only briefly, and the pool's deadline still applies."""
        if self._closed:
            return
        self._closed = True
        if self.broken:
            self.slot.forget()
            return
        busy = self._running is not None and not self._running.done()
        env_id = self.slot.env_id
        close = self.slot.submit(lambda call: Close(call, env_id), Closed, timeout_s=self.timeout_s)
        try:
            reply = await (asyncio.wait_for(asyncio.shield(close), CLOSE_GRACE_S) if busy else asyncio.shield(close))
        except TimeoutError:
            return  # it closes after the running call; nobody waits on this env any more
        if isinstance(reply, Failed):
            raise EnvFailure(f"env {self.name!r}: close() raised {reply.error}")

    async def _call(self, op: str, request: Callable[[int], Request], answer: type[Done]) -> Done:
        if self._closed:
            raise EnvFailure(f"env {self.name!r}: {op}() refused: the runner is closed")
        if self._broken is not None:
            raise EnvFailure(f"env {self.name!r}: {op}() refused: the env is broken ({self._broken})")
        if (ended := self.worker.ended) is not None:
            raise EnvFailure(f"env {self.name!r}: {op}() refused: its {self.worker.describe()} died: {ended}")
        future = self.slot.submit(request, answer, timeout_s=self.timeout_s)
        self._running = future
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            reply = await asyncio.shield(future)
        except EnvFailure as exc:  # timed out (its worker killed), the worker died, or it answered nonsense
            self._broken = str(exc)
            raise
        if isinstance(reply, Failed):
            raise EnvFailure(f"env {self.name!r}: {op}() raised {reply.error}")
        await self._wait_out(reply.wait_s, deadline, op)
        return reply

    async def _wait_out(self, wait_s: float, deadline: float, op: str) -> None:
        """The simulated time the env says its call took, within the call's deadline (as `EnvRunner`)."""
        if wait_s <= 0:
            return
        try:
            async with asyncio.timeout_at(deadline):
                await self.clock.sleep(wait_s)
        except TimeoutError:
            self._broken = f"{op}() timed out after {self.timeout_s:g} s"
            raise EnvFailure(f"env {self.name!r}: {self._broken}") from None
