"""The reward worker process: receive a job, run the reward function, send the verdict back.

`RewardPool` starts `worker_main` in a `spawn`ed process with one end of a duplex
`multiprocessing.Pipe`. The conversation, one job at a time:

    worker -> pool   Ready(pid)                       once imports are done (ends the cold start)
                     StartFailed(reason)              instead, if a preload import failed
    pool -> worker   Job(req_id, name, fn_ref, item)  fn_ref: pickled reference; item: msgpack ScoreInput
    worker -> pool   Done(req_id, output)             output: msgpack ScoreOutput
                     Failed(req_id, message)          the function raised, or returned something invalid
    pool -> worker   None                             finish and exit (retirement, pool close)

The function arrives as a pickled reference (module + name), so functions registered in the
parent after the worker started still resolve here. A worker that dies (os._exit, a signal, a
segfault in native code) fails only its current job; the pool notices through the process sentinel.
"""

from __future__ import annotations

import importlib
import math
import os
import pickle
import signal
from multiprocessing.connection import Connection
from typing import NamedTuple

import msgspec

from rollart.rewards.base import RewardError, ScoreInput, ScoreOutput


class Ready(NamedTuple):
    """The worker finished importing and waits for jobs."""

    pid: int


class StartFailed(NamedTuple):
    """The worker could not get ready (a preload import failed); it exits after sending this."""

    reason: str


class Job(NamedTuple):
    """One scoring request."""

    req_id: int
    name: str
    fn_ref: bytes
    item: bytes


class Done(NamedTuple):
    """A job's result: a msgpack-encoded `ScoreOutput`."""

    req_id: int
    output: bytes


class Failed(NamedTuple):
    """A job's failure, as the message the caller's `RewardError` will carry."""

    req_id: int
    message: str


WorkerMessage = Ready | StartFailed | Done | Failed

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ScoreInput)


def run_job(job: Job) -> Done | Failed:
    """Run one job; every failure becomes a `Failed` naming the function and what went wrong."""
    try:
        fn = pickle.loads(job.fn_ref)
    except Exception as e:  # any import-time error of the user's module belongs to this job only
        return Failed(job.req_id, f"reward {job.name!r} could not be loaded in the worker: {type(e).__name__}: {e}")
    try:
        item = _decoder.decode(job.item)
        out = fn(item)
    except RewardError as e:
        return Failed(job.req_id, str(e))
    except msgspec.DecodeError as e:
        return Failed(job.req_id, f"reward {job.name!r}: undecodable ScoreInput: {e}")
    except Exception as e:  # a bug in a reward function fails its request, not the worker
        return Failed(job.req_id, f"reward {job.name!r} failed: {type(e).__name__}: {e}")
    if not isinstance(out, ScoreOutput):
        return Failed(job.req_id, f"reward {job.name!r} returned {type(out).__name__}, expected ScoreOutput")
    if isinstance(out.reward, bool) or not isinstance(out.reward, int | float) or not math.isfinite(out.reward):
        return Failed(job.req_id, f"reward {job.name!r} returned a non-finite or non-numeric reward {out.reward!r}")
    try:
        return Done(job.req_id, _encoder.encode(out))
    except (TypeError, msgspec.EncodeError) as e:
        return Failed(job.req_id, f"reward {job.name!r} returned details that msgpack cannot encode: {e}")


_in_worker = False


def in_reward_worker() -> bool:
    """True inside a pool worker process (where a function may take over process-wide settings)."""
    return _in_worker


def worker_main(conn: Connection, preload: tuple[str, ...]) -> None:
    """The worker's loop (the target of the spawned process)."""
    global _in_worker  # noqa: PLW0603 -- one flag per process, set once at its start
    _in_worker = True
    # Ctrl-C reaches the whole process group; the pool decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The pool's parallelism is its processes: N workers with N math threads each would
    # oversubscribe the host. Read by torch, numpy and friends when they are first imported.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    try:
        for module in preload:
            importlib.import_module(module)
    except Exception as e:  # reported to the pool, which fails the waiting requests with this reason
        conn.send(StartFailed(f"preload of {module!r} failed: {type(e).__name__}: {e}"))
        return
    conn.send(Ready(os.getpid()))
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the pool is gone; nobody is left to answer
            return
        if job is None:
            return
        conn.send(run_job(job))
