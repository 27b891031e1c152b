"""Starting one env worker process: its socket pair, its command line, and the watch on its end.

`EnvWorkerPool` decides when a worker starts and what happens to it; this module does the start.
The worker is a fresh interpreter (`rollart.envexec.worker`, through its `BOOTSTRAP`) given the
parent's `sys.path`, a `WorkerConfig` on its command line, the environment the pool built, and one
end of a socket pair. From the moment it exists, the loop watches its socket (replies) and its
process (a pidfd, or a thread where there are none) and calls back into the pool.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping

import msgspec

from rollart.envexec.handles import EnvWorker, consume
from rollart.envexec.isolation import WorkerLimits
from rollart.envexec.worker import BOOTSTRAP, WorkerConfig

WorkerCallback = Callable[[EnvWorker], None]


def start_worker(
    wid: int,
    loop: asyncio.AbstractEventLoop,
    *,
    env_modules: list[str],
    limits: WorkerLimits,
    environ: Mapping[str, str],
    on_readable: WorkerCallback,
    on_exit: WorkerCallback,
) -> EnvWorker:
    """Start worker `wid` (`OSError` if the OS refuses); `on_readable(worker)` runs when its socket
    has bytes (or EOF), `on_exit(worker)` once its process has exited. Call from the loop's thread."""
    parent, child = socket.socketpair()
    config = WorkerConfig(
        fd=child.fileno(),
        parent_pid=os.getpid(),
        env_modules=env_modules,
        cpu_time_s=limits.cpu_time_s,
        memory_mb=limits.memory_mb,
        open_files=limits.open_files,
    )
    argv = [sys.executable, "-c", BOOTSTRAP, json.dumps(sys.path), msgspec.json.encode(config).decode()]
    try:
        # From the loop's thread, which lives as long as the process: PR_SET_PDEATHSIG fires
        # when the thread that started the worker ends.
        proc = subprocess.Popen(argv, env=dict(environ), pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()  # only the worker holds its end now, so its death reads as EOF here
    parent.setblocking(False)
    worker = EnvWorker(wid, proc, parent, loop.create_future(), loop.create_future())
    worker.ready.add_done_callback(consume)
    loop.add_reader(parent.fileno(), on_readable, worker)
    try:
        worker.pidfd = os.pidfd_open(worker.pid)
        loop.add_reader(worker.pidfd, on_exit, worker)
    except (AttributeError, OSError):  # no pidfds (not Linux): a thread waits for the exit
        loop.run_in_executor(None, proc.wait).add_done_callback(lambda _: on_exit(worker))
    return worker
