"""The reward worker process: receive a job, run the reward function, send the verdict back.

`RewardPool` starts it as a fresh interpreter (`rollart.workers.spawn`) with an environment the
pool built (without the node's secrets), the parent's `sys.path`, and one end of a socket pair:

    python -c BOOTSTRAP '<sys.path as JSON>' '<WorkerConfig as JSON>'

At start it ties its life to the gateway's (`PR_SET_PDEATHSIG` on Linux; everywhere, the end of its
socket), sets its limits (`rollart.workers.limits`: CPU seconds, address space, open files, no core
files), imports the `preload` modules, says `Ready`, and then runs one job at a time until told to
`Stop` or the socket closes (`rollart.rewards.wire`). Each job names its function by
`module:qualname`, imported here; whatever the function raises or returns wrong becomes that job's
`Failed`, and the worker goes on. A worker that dies (`os._exit`, a signal, a limit, a segfault in
native code) fails only its current job.
"""

from __future__ import annotations

import importlib
import math
import os
import socket
import time
from collections.abc import Callable
from typing import BinaryIO, NoReturn

import msgspec

from rollart.rewards.base import RewardError, ScoreInput, ScoreOutput, resolve
from rollart.rewards.wire import (
    Done,
    Failed,
    Job,
    Ready,
    StartFailed,
    Stop,
    reply_decoder,
    reply_encoder,
    request_decoder,
)
from rollart.workers.framing import DECODE_ERRORS, recv_frame, send_frame
from rollart.workers.spawn import WorkerStart, enter_worker


class WorkerConfig(WorkerStart, frozen=True, kw_only=True):
    """What a reward worker is told on its command line: `WorkerStart` and the modules to import first."""

    preload: list[str] = msgspec.field(default_factory=list)


def _load(job: Job) -> Callable[[ScoreInput], object]:
    """The function `job.fn` names, imported; `RewardError` with the reason if it cannot be."""
    try:
        fn: Callable[[ScoreInput], object] = resolve(job.fn)  # a user's function may return anything
        return fn
    except Exception as e:  # any import-time error of the user's module belongs to this job only
        where = " (defined in the main script, which a worker does not run: move it to a module)"
        hint = where if job.fn.startswith("__main__:") else ""
        raise RewardError(
            f"reward {job.name!r} could not be loaded in the worker: {type(e).__name__}: {e}{hint}"
        ) from None


def run_job(job: Job) -> Done | Failed:
    """Run one job; every failure becomes a `Failed` naming the function and what went wrong."""
    cpu = time.process_time
    try:
        fn = _load(job)
        out = fn(job.item)
    except RewardError as e:
        return Failed(job.req_id, str(e), cpu())
    except Exception as e:  # a bug in a reward function fails its request, not the worker
        return Failed(job.req_id, f"reward {job.name!r} failed: {type(e).__name__}: {e}", cpu())
    if not isinstance(out, ScoreOutput):
        return Failed(job.req_id, f"reward {job.name!r} returned {type(out).__name__}, expected ScoreOutput", cpu())
    if isinstance(out.reward, bool) or not isinstance(out.reward, int | float) or not math.isfinite(out.reward):
        reason = f"reward {job.name!r} returned a non-finite or non-numeric reward {out.reward!r}"
        return Failed(job.req_id, reason, cpu())
    return Done(job.req_id, out, cpu())


def _encode(job: Job, reply: Done | Failed) -> bytes:
    """`reply` as the pool will decode it: details that msgpack cannot carry, or that do not decode as
    `ScoreOutput` (keys that are not str), fail the job here, as the function's fault; the pool takes
    a reply that does not decode for a broken worker and kills it."""
    try:
        data = reply_encoder.encode(reply)
        reply_decoder.decode(data)
    except (TypeError, ValueError, msgspec.EncodeError, *DECODE_ERRORS) as e:
        message = f"reward {job.name!r} returned details that msgpack cannot carry: {e}"
        return reply_encoder.encode(Failed(job.req_id, message, time.process_time()))
    return data


def _send(sock: socket.socket, payload: bytes) -> None:
    try:
        send_frame(sock, payload)
    except OSError:  # the pool is gone; nobody is left to answer
        os._exit(0)


_in_worker = False


def in_reward_worker() -> bool:
    """True inside a pool worker process (where a function may take over process-wide settings)."""
    return _in_worker


def serve(sock: socket.socket, config: WorkerConfig) -> NoReturn:
    """Import the preload modules, say `Ready`, then run jobs until `Stop` or the socket's end."""
    try:
        for module in config.preload:
            importlib.import_module(module)
    except BaseException as e:  # SystemExit and the like too; the pool fails waiting requests with this
        reason = f"preload of {module!r} failed: {type(e).__name__}: {e}"
        _send(sock, reply_encoder.encode(StartFailed(reason)))
        os._exit(1)
    _send(sock, reply_encoder.encode(Ready(os.getpid())))
    stream: BinaryIO = sock.makefile("rb")
    while (payload := recv_frame(stream)) is not None:
        request = request_decoder.decode(payload)
        if isinstance(request, Stop):
            break
        _send(sock, _encode(request, run_job(request)))
    os._exit(0)  # Stop, or the pool closed its end


def main(config_json: str) -> None:
    """The worker's entry point (`rollart.workers.spawn.bootstrap`)."""
    global _in_worker  # noqa: PLW0603 -- one flag per process, set once at its start
    config = msgspec.json.decode(config_json, type=WorkerConfig)
    sock = enter_worker(config)
    _in_worker = True
    # The pool's parallelism is its processes: N workers with N math threads each would
    # oversubscribe the host. Read by torch, numpy and friends when they are first imported.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    serve(sock, config)
