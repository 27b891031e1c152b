"""EnvWorkerPool: a few long-lived env worker processes, each hosting many envs, that can be killed.

An env in a thread of the env-host cannot be stopped once it hangs, and it shares the node's
memory, CPU and secrets. An env in a worker process (`rollart.envexec.worker`) runs under resource
limits, with an environment that holds none of the node's credentials, and a call past its
deadline kills its process. Starting an interpreter costs about 0.25 s, and an env-host runs
dozens of trajectories at once, each seconds long, so workers are not started per env: the pool
keeps `processes` of them, each hosting any number of envs (one thread per env inside), and puts
each new env on the worker with the fewest.

    async with EnvWorkerPool(processes=4, env_modules=["my_pkg.my_envs"]) as pool:
        runner = await pool.open("maze", {"size": 7}, timeout_s=10)   # a WorkerEnvRunner
        obs, info = await runner.reset(seed)
        ...
        await runner.close()

The trade-off of sharing a process: whatever ends a worker ends every env in it. A call past its
deadline kills its worker (SIGKILL: that is the only way to stop a hung env), and so does a
crash (a segfault, `os._exit`), a limit (SIGXCPU at `cpu_time_s`) or a reply that is too long or
not msgpack. The call that caused it fails with its cause; every other call then in flight in
that worker fails with `EnvFailure("... its env worker 2 (pid 4711) died: killed by SIGXCPU
(cpu_time_s 60 exceeded)")`, and the other envs it hosted refuse their next call with that
cause, so each of those trajectories fails (its group's redundancy covers some) while the
env-host and every other worker go on. The pool starts a replacement at once. More processes
mean fewer bystanders per failure and more memory. A raising env (MemoryError included) and a
reply of the wrong kind for its call (`WorkerReplyError`) fail that call alone and kill nobody.

Limits are per worker, as the kernel keeps them (`rollart.workers.limits`). So that the CPU
limit stops runaway envs and not merely old workers, a worker that has used `RETIRE_AT` of it
takes no new envs, a fresh worker takes its place, and it is stopped once its last env is closed.

Everything is driven by the event loop, with no thread and no polling: each worker's socket and
its process (a pidfd) are watched with `add_reader`; deadlines are `call_later` timers.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog

from rollart.clock import SimClock
from rollart.envexec import wire
from rollart.envexec.handles import EnvWorker, PendingCall, WorkerState, consume
from rollart.envexec.process_runner import EnvSlot, WorkerEnvRunner
from rollart.envs.base import EnvFailure
from rollart.errors import ConfigError
from rollart.workers.framing import frame
from rollart.workers.limits import WorkerLimits, child_environ, exit_cause
from rollart.workers.spawn import NO_SANDBOX, Launch

log = structlog.get_logger("rollart.envexec.pool")

RETIRE_AT = 0.5
"""Share of `cpu_time_s` after which a worker takes no new envs and is replaced."""
KILL_GRACE_S = 5.0
"""How long a killed worker may take to exit before the pool stops waiting for it."""
START_TIMEOUT_S = 60.0
"""How long `start` waits for the workers to import the env modules."""
MAX_START_FAILURES = 3
"""Workers in a row that die before they are ready, after which the pool starts no more."""


class EnvWorkerPool:
    """Env worker processes on one env-host; see the module docstring."""

    def __init__(
        self,
        *,
        processes: int = 4,
        env_modules: Iterable[str] = (),
        limits: WorkerLimits | None = None,
        environ: Mapping[str, str] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        launch: Launch = NO_SANDBOX,
    ) -> None:
        """`environ`: the workers' environment (default: `child_environ(os.environ)`); `launch`: their
        interpreter and sandbox (`rollart.workers.sandbox.worker_launch`; default: the node's, none)."""
        if processes < 1:
            raise ConfigError(f"env worker pool: processes must be >= 1, got {processes}")
        self.processes = processes
        self.env_modules = list(env_modules)
        self.limits = limits or WorkerLimits()
        self.environ = dict(child_environ(os.environ) if environ is None else environ)
        self.start_timeout_s = start_timeout_s
        self.launch = launch
        self.user_envs: frozenset[str] = frozenset()
        """Env names and family prefixes (`p:`) that the env modules registered or replaced (known after `start`)."""
        self.counts = {"started": 0, "died": 0, "timeouts": 0, "retired": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: list[EnvWorker] = []
        self._running = False
        self._closed = False
        self._wids = itertools.count()
        self._call_ids = itertools.count()
        self._env_ids = itertools.count()
        self._start_failures = 0
        self._last_start_error = ""

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the workers and wait until they have imported the env modules.

        `ConfigError` if a module fails to import there (naming it) or the interpreter is not an
        executable (or, sandboxed, a relative path), `EnvFailure` if the workers cannot start
        otherwise; the pool is closed then."""
        if self._loop is not None:
            raise RuntimeError("EnvWorkerPool.start() called twice")
        # Checked here: in a sandbox the launcher's exec fails, and the pool would see only exit code 127.
        python = self.launch.python
        if shutil.which(python, path=self.environ.get("PATH", os.defpath)) is None:
            await self.close()
            raise ConfigError(f"run.rollout.env_workers.python: {python!r} is not an executable file")
        if self.launch.launcher and os.sep in python and not os.path.isabs(python):
            await self.close()
            raise ConfigError(
                f"run.rollout.env_workers.python: {python!r} is relative, and a sandboxed worker starts in its"
                " scratch directory: give an absolute path"
            )
        self._loop = asyncio.get_running_loop()
        try:
            for _ in range(self.processes):
                self._spawn()
            async with asyncio.timeout(self.start_timeout_s):
                ready = await asyncio.gather(*(asyncio.shield(w.ready) for w in self._workers), return_exceptions=True)
        except (OSError, TimeoutError) as exc:
            await self.close()
            raise EnvFailure(f"env workers did not start: {exc or 'timed out'}") from exc
        except BaseException:
            await self.close()
            raise
        errors = [r for r in ready if isinstance(r, BaseException)]
        if errors:
            await self.close()
            if self._last_start_error.startswith("run.env_modules"):
                raise ConfigError(self._last_start_error)
            raise EnvFailure(f"env workers did not start: {errors[0]}")
        self._running = True
        log.info("env_pool.started", processes=self.processes, pids=self.pids(), user_envs=sorted(self.user_envs))

    async def close(self) -> None:
        """Kill every worker (what runs in them is abandoned; their calls fail) and wait for them to exit."""
        if self._closed:
            return
        self._closed = True
        self._running = False
        if self._loop is None:  # never started: nothing to stop
            return
        workers = list(self._workers)
        for worker in workers:
            self._kill(worker, "the env worker pool closed")
        if workers:
            await asyncio.wait([w.exited for w in workers], timeout=KILL_GRACE_S)
        log.info("env_pool.closed", **self.counts)

    async def __aenter__(self) -> EnvWorkerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- envs ------------------------------------------------------------------------------

    async def open(
        self, name: str, kwargs: dict[str, Any] | None = None, *, timeout_s: float, clock: SimClock | None = None
    ) -> WorkerEnvRunner:
        """Build `make_env(name, **kwargs)` in a worker and return its runner; `timeout_s` bounds
        this and every later call. `EnvFailure` if it cannot be built (the cause named)."""
        if not self._running or self._loop is None:
            why = "closed" if self._closed else "not started"
            raise EnvFailure(f"env {name!r}: make() refused: the env worker pool is {why}")
        deadline = self._loop.time() + timeout_s
        worker = self._pick(name)
        env_id = next(self._env_ids)
        worker.envs.add(env_id)
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(worker.ready)
        except TimeoutError:
            self.forget(worker, env_id)
            raise EnvFailure(f"env {name!r}: make() timed out waiting for {worker.describe()} to start") from None
        except EnvFailure as exc:  # it died before it was ready
            self.forget(worker, env_id)
            raise EnvFailure(f"env {name!r}: make() failed: {exc}") from None
        except BaseException:
            self.forget(worker, env_id)
            raise
        left = max(deadline - self._loop.time(), 0.001)
        future = self.submit(
            worker, env_id, name, lambda call: wire.Make(call, env_id, name, kwargs or {}), wire.Made, timeout_s=left
        )
        try:
            reply = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda made: self._abandon(worker, env_id, name, timeout_s, made))
            raise
        if isinstance(reply, wire.Failed):
            raise EnvFailure(f"env {name!r}: make() raised {reply.error}")
        return WorkerEnvRunner(EnvSlot(self, worker, env_id, name), reply, timeout_s=timeout_s, clock=clock)

    def submit(
        self,
        worker: EnvWorker,
        env_id: int,
        env_name: str,
        request: Callable[[int], wire.Request],
        answer: type[wire.Answer],
        *,
        timeout_s: float,
    ) -> asyncio.Future[wire.Answer | wire.Failed]:
        """Send `request(call_id)` to `worker`; the future gets its `answer` (or `Failed`). It fails
        with `EnvFailure` if the worker dies first, `WorkerReplyError` if the worker answers with
        another kind of reply; past `timeout_s` without a reply the worker is killed, whether or not
        anyone waits."""
        assert self._loop is not None
        future: asyncio.Future[wire.Answer | wire.Failed] = self._loop.create_future()
        future.add_done_callback(consume)
        call = PendingCall(next(self._call_ids), worker, env_id, env_name, wire.OPS[answer], answer, timeout_s, future)
        if worker.state is WorkerState.DEAD:
            future.set_exception(EnvFailure(call.failure()))
            return future
        worker.calls[call.call_id] = call
        call.timer = self._loop.call_later(timeout_s, self._on_deadline, call)
        worker.send(frame(wire.request_encoder.encode(request(call.call_id))), self._loop)
        return future

    def forget(self, worker: EnvWorker, env_id: int) -> None:
        """Stop counting an env on its worker (never built, or its worker died)."""
        worker.envs.discard(env_id)
        self._retire_if_done(worker)

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [w.pid for w in self._workers]

    def stats(self) -> dict[str, Any]:
        """For `/status`: each worker's state, envs and CPU, and the pool's counts."""
        workers = [
            {"pid": w.pid, "state": w.state.name.lower(), "envs": len(w.envs), "cpu_s": round(w.cpu_s, 2)}
            for w in self._workers
        ]
        return {"processes": self.processes, "workers": workers, **self.counts}

    # -- workers ---------------------------------------------------------------------------

    def _pick(self, name: str) -> EnvWorker:
        """The worker with the fewest envs among those ready (else starting); `EnvFailure` if none can start."""
        self._replace()
        live = [w for w in self._workers if w.takes_envs]
        if not live:
            raise EnvFailure(f"env {name!r}: make() refused: env workers fail to start ({self._last_start_error})")
        ready = [w for w in live if w.state is WorkerState.READY]
        return min(ready or live, key=lambda w: len(w.envs))

    def _spawn(self) -> EnvWorker:
        """Start one worker (`OSError` if the OS refuses); its socket and its exit are watched from here on."""
        assert self._loop is not None
        worker = EnvWorker.start(
            next(self._wids),
            self._loop,
            env_modules=self.env_modules,
            limits=self.limits,
            environ=self.environ,
            on_readable=self._on_readable,
            on_exit=self._on_exit,
            launch=self.launch,
        )
        self._workers.append(worker)
        self.counts["started"] += 1
        log.info("env_pool.worker_started", worker=worker.wid, pid=worker.pid)
        return worker

    def _replace(self) -> None:
        """Start workers until `processes` take new envs (not while closing, nor after repeated start failures)."""
        while self._running and self._start_failures < MAX_START_FAILURES:
            if sum(w.takes_envs for w in self._workers) >= self.processes:
                return
            try:
                self._spawn()
            except OSError as exc:  # out of processes or descriptors
                self._start_failures += 1
                self._last_start_error = f"cannot start a process: {exc}"
                log.error("env_pool.spawn_failed", error=str(exc))

    def _kill(self, worker: EnvWorker, cause: str) -> None:
        if worker.state is WorkerState.DEAD or worker.kill_cause is not None:
            return
        worker.kill_cause = cause
        worker.process.proc.kill()
        assert self._loop is not None
        self._loop.call_later(KILL_GRACE_S, self._bury, worker, exit_cause(None, self.limits))

    def _retire_if_done(self, worker: EnvWorker) -> None:
        if worker.state is WorkerState.READY and worker.cpu_s >= RETIRE_AT * self.limits.cpu_time_s:
            worker.state = WorkerState.RETIRING
            self.counts["retired"] += 1
            log.info("env_pool.worker_retiring", worker=worker.wid, pid=worker.pid, cpu_s=round(worker.cpu_s, 2))
            self._replace()
        if worker.state is WorkerState.RETIRING and not worker.envs and not worker.calls:
            self._kill(worker, "retired")

    def _bury(self, worker: EnvWorker, cause: str) -> None:
        """The worker is gone: fail its calls, forget its envs, and replace it."""
        if worker.state is WorkerState.DEAD:
            return
        expected = worker.state is WorkerState.RETIRING or self._closed
        was_starting = worker.state is WorkerState.STARTING
        worker.state = WorkerState.DEAD
        worker.death = worker.kill_cause or cause
        self._workers.remove(worker)
        if not worker.ready.done():
            why = worker.start_error or worker.death
            worker.ready.set_exception(EnvFailure(f"{worker.describe()} died before it was ready: {why}"))
        for call in worker.calls.values():
            if call.timer is not None:
                call.timer.cancel()
            if not call.future.done():
                call.future.set_exception(EnvFailure(call.failure()))
        hosted = len(worker.envs)
        worker.calls.clear()
        worker.envs.clear()
        if not expected:
            self.counts["died"] += 1
            log.warning("env_pool.worker_died", worker=worker.wid, pid=worker.pid, cause=worker.death, envs=hosted)
            if was_starting:
                self._start_failures += 1
                self._last_start_error = worker.start_error or f"{worker.describe()}: {worker.death}"
        self._replace()

    # -- loop callbacks --------------------------------------------------------------------

    def _on_readable(self, worker: EnvWorker) -> None:
        assert self._loop is not None
        data = worker.process.receive()
        if data is None:
            return
        if not data:  # EOF: the worker is exiting, and its process watch says how
            worker.process.stop_reading(self._loop)
            return
        self._take(worker, data)

    def _take(self, worker: EnvWorker, data: bytes) -> None:
        replies, broken = worker.feed(data)
        for reply in replies:
            self._on_reply(worker, reply)
        if broken is not None:
            self._kill(worker, f"killed by the pool: {broken}")

    def _on_reply(self, worker: EnvWorker, reply: wire.Reply) -> None:
        if isinstance(reply, wire.Ready):
            if worker.state is WorkerState.STARTING:
                worker.state = WorkerState.READY
                self._start_failures = 0
                self.user_envs = frozenset(reply.user_envs)
                worker.ready.set_result(reply)
                log.info("env_pool.worker_ready", worker=worker.wid, pid=worker.pid)
            return
        if isinstance(reply, wire.StartFailed):
            worker.start_error = reply.reason
            return
        call = worker.settle(reply)
        if call is not None and call.failed_by is not None:
            log.warning("env_pool.wrong_reply", worker=worker.wid, pid=worker.pid, call=call.op, got=call.failed_by)
        self._retire_if_done(worker)

    def _on_deadline(self, call: PendingCall) -> None:
        worker = call.worker
        if call.future.done() or worker.kill_cause is not None or worker.state is WorkerState.DEAD:
            return  # answered, or its worker is going anyway (the call fails with that cause)
        call.timed_out = True
        self.counts["timeouts"] += 1
        log.warning("env_pool.call_timed_out", worker=worker.wid, pid=worker.pid, env=call.env_name, call=call.op)
        late = f"env {call.env_name!r}: {call.op}() ran past its {call.timeout_s:g} s deadline"
        self._kill(worker, f"killed by the pool: {late}")

    def _on_exit(self, worker: EnvWorker) -> None:
        assert self._loop is not None
        code = worker.process.proc.wait()  # at once: the process has exited
        while worker.kill_cause is None and (data := worker.process.receive()):  # replies sent just before it died
            self._take(worker, data)
        worker.process.release(self._loop)
        self._bury(worker, exit_cause(code, self.limits))
        worker.exited.set_result(None)

    def _abandon(self, worker: EnvWorker, env_id: int, name: str, timeout_s: float, made: asyncio.Future[Any]) -> None:
        """A `make` whose caller was cancelled: close the env once it is built."""
        if made.cancelled() or made.exception() is not None or not isinstance(made.result(), wire.Made):
            return
        self.submit(worker, env_id, name, lambda call: wire.Close(call, env_id), wire.Closed, timeout_s=timeout_s)
