"""Starting a worker process and holding it: its socket pair, its command line, the watch on its end.

Each pool decides when its workers start and what happens to them; this module does the start,
the same for env workers and reward workers. A worker is a fresh interpreter given the parent's
`sys.path`, its config as JSON, the environment its pool built, and one end of a socket pair:

    [launcher ...] python -c BOOTSTRAP '<sys.path as JSON>' '<config as JSON>'

`BOOTSTRAP` (`bootstrap(main_module)`) imports the worker's module and calls its `main(config_json)`;
its config is a `WorkerStart` (the socket's descriptor, the parent's pid, the limits) with the
kind's own fields.
`launcher` goes before the interpreter (a sandbox's command line). From `watch` on, the loop
watches the parent's end of the socket (the worker's frames) and the process (a pidfd, or a thread
where there are none) and calls back into the pool.

In the worker, `enter_worker` comes first: it ties the worker's life to its parent's, sets the
signals a worker keeps, takes its socket and sets its limits.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from rollart.workers.framing import FrameReader
from rollart.workers.limits import WorkerLimits, set_limits

RECV_BYTES = 1 << 18


def bootstrap(main_module: str, *, own_python: bool = False) -> str:
    """The `python -c` program of a worker: the parent's import path first (with `own_python`, an
    interpreter of its own, only the project's part of it, ahead of the interpreter's own), then
    `main_module.main`."""
    path = "sys.path[:0] = json.loads(sys.argv[1])" if own_python else "sys.path[:] = json.loads(sys.argv[1])"
    return "\n".join(["import json, sys", path, f"from {main_module} import main", "main(sys.argv[2])"])


@dataclass(frozen=True)
class Launch:
    """How a pool starts its workers: the interpreter, and what goes before it (a sandbox's command
    line, `rollart.workers.sandbox.worker_launch`; empty for none)."""

    launcher: tuple[str, ...] = ()
    python: str = sys.executable
    """The workers' interpreter; another than the node's (`env_workers.python`) keeps its own packages:
    only the project's import paths are put ahead of its own."""
    described: str = "no sandbox"
    """What the workers run in, for the node's /status and log."""


def returncode(code: int | None) -> int | None:
    """A sandboxed process's exit status as Popen's `returncode` would be without the sandbox: the
    tools report a death by signal n as 128 + n, Popen as -n."""
    if code is not None and code > 128 and (code - 128) in signal.valid_signals():
        return -(code - 128)
    return code


NO_SANDBOX = Launch()
"""Workers on the node's interpreter, in no sandbox (pools' default)."""


def import_path(python: str) -> list[str]:
    """The import path a worker on `python` is given: the node's, absolute (a sandboxed worker starts in
    its scratch directory); for another interpreter only the entries outside the node's own Python (the
    project, the users' module folders), so the worker's packages are its interpreter's, with the folder
    that holds `rollart` first (an editable install is found through the node's site-packages, which
    the worker does not get; a `rollart` installed there must be installed in the other Python too)."""
    entries = [os.path.abspath(p) for p in sys.path]
    if python == sys.executable:
        return entries
    installs = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    project = str(Path(__file__).resolve().parents[2])
    kept = [
        p for p in dict.fromkeys([project, *entries]) if not any(p == t or p.startswith(t + os.sep) for t in installs)
    ]
    return kept


class WorkerStart(msgspec.Struct, frozen=True, kw_only=True):
    """What every worker is told on its command line; each kind's config adds its own fields."""

    fd: int
    """Its end of the socket pair."""
    parent_pid: int
    """The node's pid, which the worker checks is still its parent; 0: do not (a sandbox's init is)."""
    limits: WorkerLimits = WorkerLimits()


@dataclass(eq=False)
class WorkerProcess:
    """A worker process as its pool holds it: the process, the parent's end of its socket, and the
    bytes on their way in and out. Its socket calls never block the loop (writes the socket cannot
    take now wait in `outbox` until it is writable) and may fail at any moment (a dying worker)."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    reader: FrameReader
    """The whole frames in what the worker sent; it refuses one over the pool's maximum."""
    pidfd: int | None = None
    outbox: bytearray = field(default_factory=bytearray)
    sandboxed: bool = False
    """Started in a sandbox, whose tools report a death by signal n as exit code 128 + n."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def watch(
        self, loop: asyncio.AbstractEventLoop, on_readable: Callable[[], None], on_exit: Callable[[], None]
    ) -> None:
        """From now on `on_readable()` runs when the socket has bytes (or EOF) and `on_exit()` once the
        process has exited. Call from the loop's thread, before the loop runs again."""
        loop.add_reader(self.sock.fileno(), on_readable)
        try:
            self.pidfd = os.pidfd_open(self.pid)
            loop.add_reader(self.pidfd, on_exit)
        except (AttributeError, OSError):  # no pidfds (not Linux): a thread waits for the exit
            loop.run_in_executor(None, self.proc.wait).add_done_callback(lambda _: on_exit())

    def send(self, data: bytes, loop: asyncio.AbstractEventLoop) -> bool:
        """Write `data` without blocking; what the socket does not take now is sent when it is writable.
        False if the socket is broken (the worker is gone, and its exit is reported by its process)."""
        if not self.outbox:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return False
            if sent == len(data):
                return True
            data = data[sent:]
            loop.add_writer(self.sock.fileno(), self._on_writable, loop)
        self.outbox += data
        return True

    def _on_writable(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            sent = self.sock.send(self.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(self.outbox)
        del self.outbox[:sent]
        if not self.outbox:
            loop.remove_writer(self.sock.fileno())

    def receive(self) -> bytes | None:
        """What the socket holds now: bytes, b"" at EOF, None when there is nothing yet."""
        try:
            return self.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    def stop_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop watching the socket (at its EOF, or when nothing more the worker sends counts)."""
        if self.sock.fileno() >= 0:
            loop.remove_reader(self.sock.fileno())

    def release(self, loop: asyncio.AbstractEventLoop) -> int | None:
        """Stop watching the socket and the process and close them; the exit code (None if it still runs)."""
        if self.pidfd is not None:
            loop.remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        if self.sock.fileno() >= 0:
            loop.remove_reader(self.sock.fileno())
            loop.remove_writer(self.sock.fileno())
            self.sock.close()
        code = self.proc.poll()
        return returncode(code) if self.sandboxed else code


def spawn(
    main_module: str,
    config: Callable[[int, int], WorkerStart],
    *,
    environ: Mapping[str, str],
    max_frame_bytes: int,
    launch: Launch = NO_SANDBOX,
) -> WorkerProcess:
    """Start a worker running `main_module.main` (`OSError` if the OS refuses). `config(fd, parent_pid)`
    is its config, given the descriptor of its end of the socket pair and the pid it checks its parent
    against (0 in a sandbox, whose init is its parent and which dies with the node already);
    `environ` its whole environment; `max_frame_bytes` the longest frame the pool takes from it;
    `launch` its interpreter and sandbox. Call from the loop's thread, then `watch` the worker."""
    parent, child = socket.socketpair()
    own = launch.python != sys.executable
    program = bootstrap(main_module, own_python=own)
    argv = [*launch.launcher, launch.python, "-c", program, json.dumps(import_path(launch.python))]
    try:
        argv.append(msgspec.json.encode(config(child.fileno(), 0 if launch.launcher else os.getpid())).decode())
        # From the loop's thread, which lives as long as the process: PR_SET_PDEATHSIG fires
        # when the thread that started the worker ends.
        proc = subprocess.Popen(argv, env=dict(environ), pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()  # only the worker holds its end now, so its death reads as EOF here
    parent.setblocking(False)
    return WorkerProcess(proc, parent, FrameReader(max_frame_bytes), sandboxed=bool(launch.launcher))


def die_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Get `sig` when the parent dies, even by SIGKILL (Linux); elsewhere the socket's EOF ends us."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, sig, 0, 0, 0)
    if parent_pid and os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(0)


def enter_worker(start: WorkerStart) -> socket.socket:
    """What a worker does first, before any user code: die with its parent; leave Ctrl-C and stop
    signals to the parent, which stops its workers itself (SIGXCPU keeps its default action, the CPU
    limit's kill, whatever the parent had); set its limits. Its socket to the parent, blocking."""
    die_with_parent(start.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGXCPU, signal.SIG_DFL)
    sock = socket.socket(fileno=start.fd)
    sock.setblocking(True)
    set_limits(start.limits)
    return sock
