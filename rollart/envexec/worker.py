"""The env worker process: builds envs by name and runs their calls, under resource limits.

`EnvWorkerPool` starts it as a fresh interpreter (`rollart.workers.spawn`) with an environment the
pool built (without the node's secrets), the parent's `sys.path`, and one end of a socket pair:

    python -c BOOTSTRAP '<sys.path as JSON>' '<WorkerConfig as JSON>'

At start it ties its life to the env-host's (`PR_SET_PDEATHSIG` on Linux; everywhere, the end of
its socket), sets its limits (`rollart.workers.limits`: CPU seconds, address space, open files, no
core files), imports `run.env_modules` (limits apply to the imports too), says `Ready` with the
env names those modules registered or replaced, and then serves calls until the socket closes.

Each env it hosts gets one thread of its own (a one-worker `ThreadPoolExecutor`, as in
`EnvRunner`), so one env's slow call does not hold up the others, and an env sees one call at a
time. Whatever a call raises (`SystemExit` and `MemoryError` included) is sent back as `Failed`;
a limit the error points to is named in it. The worker never exits on its own while the socket
is open: only the kernel (a limit, a crash) or the pool (a call past its deadline) ends it.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, NoReturn

import msgspec

from rollart.envexec.wire import (
    CallReply,
    Close,
    Closed,
    Failed,
    Made,
    Make,
    Ready,
    Request,
    Reset,
    ResetDone,
    StartFailed,
    Step,
    StepDone,
    reply_encoder,
    request_decoder,
)
from rollart.envs.base import Env
from rollart.envs.registry import import_env_modules, make_env, registered_factories
from rollart.errors import ConfigError
from rollart.workers.framing import frame, recv_frame
from rollart.workers.spawn import WorkerStart, enter_worker

THREAD_STACK_BYTES = 4 * 2**20
"""Stack of each env's thread. The address-space limit counts every thread's whole stack, and
the default (the stack rlimit, often 8 MiB) would spend it on stacks."""


class WorkerConfig(WorkerStart, frozen=True, kw_only=True):
    """What an env worker is told on its command line: `WorkerStart` and the modules to import."""

    env_modules: list[str] = msgspec.field(default_factory=list)


def _import_user_modules(modules: list[str]) -> list[str]:
    """Import `run.env_modules`; the env names and family prefixes (`p:`) they registered or replaced."""
    before = registered_factories()
    import_env_modules(modules)
    return sorted(name for name, factory in registered_factories().items() if before.get(name) is not factory)


class EnvHost:
    """The worker's envs by id, each with its own thread, and the socket replies go out on."""

    def __init__(self, sock: socket.socket, config: WorkerConfig) -> None:
        self.sock = sock
        self.config = config
        self.envs: dict[int, Env] = {}
        self.threads: dict[int, ThreadPoolExecutor] = {}
        self._send_lock = threading.Lock()

    def send(self, reply: msgspec.Struct) -> None:
        try:
            data = frame(reply_encoder.encode(reply))
        except Exception as exc:  # an info that msgpack cannot carry, or whose str() raises: the env's fault
            failed = Failed(getattr(reply, "call", -1), f"the result could not be sent: {exc}", time.process_time())
            data = frame(reply_encoder.encode(failed))
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:  # the env-host is gone
                os._exit(0)

    def handle(self, request: Request) -> None:
        """Hand a request to its env's thread (a new one for `Make`)."""
        if isinstance(request, Make):
            thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"env-{request.env}")
            self.threads[request.env] = thread
        elif (found := self.threads.get(request.env)) is None:
            self.send(Failed(request.call, f"LookupError: no env {request.env} in this worker", time.process_time()))
            return
        else:
            thread = found
        try:
            thread.submit(self.run, request)
        except RuntimeError as exc:  # "can't start new thread": out of memory or processes
            self.threads.pop(request.env, None)
            self.send(Failed(request.call, self.describe(exc), time.process_time()))

    def run(self, request: Request) -> None:
        """One call, in the env's thread; the reply goes out from here."""
        try:
            reply = self.call(request)
        except BaseException as exc:  # whatever env code raises belongs to its caller
            reply = Failed(request.call, self.describe(exc), time.process_time())
            if isinstance(request, Make | Close):
                self.drop(request.env)
        self.send(reply)

    def call(self, request: Request) -> CallReply:
        cpu = time.process_time
        match request:
            case Make(call=call, env=env_id, name=name, kwargs=kwargs):
                env = make_env(name, **kwargs)
                self.envs[env_id] = env
                return Made(call, str(env.profile), int(env.max_turns), str(env.system_prompt), cpu())
            case Reset(call=call, env=env_id, seed=seed):
                env = self.envs[env_id]
                obs, info = env.reset(seed)
                return ResetDone(call, _text(obs, "reset"), _info(info, "reset"), env.wait_s, cpu())
            case Step(call=call, env=env_id, action=action):
                env = self.envs[env_id]
                obs, reward, terminated, truncated, info = env.step(action)
                info = _info(info, "step")
                return StepDone(
                    call, _text(obs, "step"), float(reward), bool(terminated), bool(truncated), info, env.wait_s, cpu()
                )
            case Close(call=call, env=env_id):
                env = self.envs[env_id]
                try:
                    env.close()
                finally:
                    self.drop(env_id)
                return Closed(call, cpu())

    def drop(self, env_id: int) -> None:
        self.envs.pop(env_id, None)
        thread = self.threads.pop(env_id, None)
        if thread is not None:
            thread.shutdown(wait=False)  # called from that very thread: it ends after this call

    def describe(self, exc: BaseException) -> str:
        """`{type}: {message}`, naming the limit when the error is one's doing."""
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "new thread" in str(exc)):
            text += f" (the env worker's memory_mb limit is {self.config.limits.memory_mb})"
        elif isinstance(exc, OSError) and exc.errno == errno.EMFILE:
            text += f" (the env worker's open_files limit is {self.config.limits.open_files})"
        return text


def _text(obs: Any, call: str) -> str:
    if not isinstance(obs, str):
        raise TypeError(f"{call}() returned a {type(obs).__name__} observation; an env's observations are str")
    return obs


def _info(info: Any, call: str) -> dict[Any, Any]:
    if not isinstance(info, dict):
        raise TypeError(f"{call}() returned a {type(info).__name__} info; an env's info is a dict")
    return info


def serve(sock: socket.socket, config: WorkerConfig) -> NoReturn:
    """Read requests until the socket closes, then exit at once (a hung env thread would block a clean exit)."""
    host = EnvHost(sock, config)
    try:
        user_envs = _import_user_modules(config.env_modules)
    except ConfigError as exc:  # a module failed to import; the message names it
        host.send(StartFailed(str(exc)))
        os._exit(1)
    except BaseException as exc:  # SystemExit and the like from a module's import
        host.send(StartFailed(f"run.env_modules: {type(exc).__name__} while importing: {exc}"))
        os._exit(1)
    host.send(Ready(os.getpid(), user_envs))
    stream: BinaryIO = sock.makefile("rb")
    while (payload := recv_frame(stream)) is not None:
        host.handle(request_decoder.decode(payload))
    os._exit(0)  # EOF: the env-host closed the socket or died


def main(config_json: str) -> None:
    """The worker's entry point (`rollart.workers.spawn.bootstrap`)."""
    config = msgspec.json.decode(config_json, type=WorkerConfig)
    sock = enter_worker(config)
    threading.stack_size(THREAD_STACK_BYTES)
    serve(sock, config)
