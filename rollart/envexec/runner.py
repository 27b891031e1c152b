"""EnvRunner: an env's blocking calls, run off the event loop, with timeouts and contained failures.

An env-host runs hundreds of trajectory coroutines on one event loop, and env code is plain
blocking Python written by anyone. The runner gives each env one worker thread of its own (a
`ThreadPoolExecutor` with one worker, so the env never sees two calls at once and needs no
locks) and awaits every call under a deadline:

    runner = EnvRunner(make_env("sokoban"), name="sokoban", timeout_s=10)
    obs, info = await runner.reset(seed)
    obs, reward, terminated, truncated, info = await runner.step(reply)
    await runner.close()

An env that says `blocking = False` (a simulated one, whose calls return at once) is called on
the event loop itself, and the simulated time it reports in `wait_s` is waited out on the
runner's `SimClock`, inside the same deadline.

Whatever goes wrong comes out as `EnvFailure`, naming the env, the call and the cause, so one bad
env fails only its own trajectory: an exception raised by the env (any kind, `SystemExit`
included), a call past its deadline, or a call on a runner that is broken or closed.
`CancelledError` passes through untouched (the trajectory was cancelled; the call in the worker
thread finishes on its own, and a later `close()` queues behind it).

A call that times out leaves the runner *broken*: every later `reset`/`step` raises at once, and
`close()` only lets go of the thread. A hung thread cannot be killed in Python: it keeps running
(and keeps its thread) until the env's code returns, and interpreter exit waits for it. Here a
timeout bounds how long a trajectory waits, not how long the env runs; an env in an env worker
process (`WorkerEnvRunner`, `rollart.envexec.pool`), with the same interface, is killed with its
process, under resource limits. `EnvHandle` (`rollart.envs.handle`) is the interface both have.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from rollart.clock import SimClock
from rollart.envs.base import Env, EnvFailure, Info, StepResult

T = TypeVar("T")


def _contain(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` in the worker thread, turning BaseExceptions (SystemExit, ...) into Exceptions,
    so the only BaseException the awaiting side sees is its own cancellation."""
    try:
        return fn(*args)
    except Exception:
        raise
    except BaseException as exc:
        raise RuntimeError(f"{type(exc).__name__} raised inside the env: {exc}") from exc


CLOSE_GRACE_S = 0.2
"""How long `close` waits for a call that outlived its cancelled caller before leaving it to finish."""


class EnvRunner:
    """Runs one env's `reset`/`step`/`close` in a worker thread under a per-call timeout."""

    def __init__(self, env: Env, *, name: str | None = None, timeout_s: float = 30.0, clock: SimClock | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.env = env
        self.clock = clock or SimClock()
        """Where a simulated env's `wait_s` is waited out."""
        self.name = name or type(env).__name__
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"env-{self.name}")
        self._broken: str | None = None
        self._closed = False
        self._running: Future[Any] | None = None
        """The latest call handed to the worker thread (it may outlive a cancelled caller)."""

    @property
    def broken(self) -> bool:
        """Whether a call timed out (the worker thread may still be stuck in it)."""
        return self._broken is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_turns(self) -> int:
        return self.env.max_turns

    @property
    def system_prompt(self) -> str:
        return self.env.system_prompt

    async def reset(self, seed: int | None = None) -> tuple[str, Info]:
        """`env.reset(seed)` in the worker thread."""
        return await self._call("reset", self.env.reset, seed)

    async def step(self, action: str) -> StepResult:
        """`env.step(action)` in the worker thread."""
        return await self._call("step", self.env.step, action)

    async def close(self) -> None:
        """`env.close()` in the worker thread (skipped if broken), then release the thread.

        Idempotent. An env whose `close` raises or hangs still gets its thread released; the
        failure is raised as `EnvFailure` once.
        """
        if self._closed:
            return
        if self._broken is None and self._running is not None and not self._running.done():
            # A call whose caller was cancelled still runs in the worker: close the env after it,
            # waiting only briefly (a drain must not wait out a slow environment).
            self._closed = True
            closing = self._executor.submit(_contain, self.env.close)
            self._executor.shutdown(wait=False)
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(closing)), CLOSE_GRACE_S)
            except TimeoutError:
                pass  # it closes when the call ends; nobody waits on this env any more
            except Exception as exc:
                raise EnvFailure(f"env {self.name!r}: close() raised {type(exc).__name__}: {exc}") from exc
            return
        try:
            if self._broken is None:
                await self._call("close", self.env.close, simulated=False)
        finally:
            self._closed = True
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _wait_out(self) -> None:
        """The simulated time the env says its call took (real envs: none), within the call's deadline."""
        if self.env.wait_s > 0:
            await self.clock.sleep(self.env.wait_s)

    async def _call(self, call: str, fn: Callable[..., T], *args: Any, simulated: bool = True) -> T:
        """`fn(*args)` under the call's deadline, then (`simulated`) the simulated time the env reports for
        it. `close` reports none: `wait_s` still holds the last step's time, which the step has waited out
        (as the process runner, whose close reply carries no time)."""
        if self._broken is not None:
            raise EnvFailure(f"env {self.name!r}: {call}() refused: the env is broken ({self._broken})")
        if self._closed:
            raise EnvFailure(f"env {self.name!r}: {call}() refused: the runner is closed")
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                try:
                    if self.env.blocking:
                        future: Future[T] = self._executor.submit(_contain, fn, *args)
                        self._running = future
                        result = await asyncio.wrap_future(future)
                    else:  # returns at once (a simulated env): no thread, nothing for a virtual clock to skip
                        result = _contain(fn, *args)
                except Exception:
                    if simulated:
                        await self._wait_out()
                    raise
                if simulated:
                    await self._wait_out()
                return result
        except TimeoutError as exc:
            if not deadline.expired():  # the env itself raised TimeoutError
                raise EnvFailure(f"env {self.name!r}: {call}() raised TimeoutError: {exc}") from exc
            self._broken = f"{call}() timed out after {self.timeout_s:g} s"
            # The stuck call holds the only worker; new calls are refused above, and queued
            # ones (none, as calls are awaited one at a time) would never run.
            self._executor.shutdown(wait=False, cancel_futures=True)
            raise EnvFailure(f"env {self.name!r}: {self._broken}") from None
        except Exception as exc:
            raise EnvFailure(f"env {self.name!r}: {call}() raised {type(exc).__name__}: {exc}") from exc
