"""Reward functions for the reward worker tests: a user's reward module, imported by the workers by
the functions' `module:qualname` (never preloaded), registered on import.

`test-hostile-pickle`, `test-oversized-reply`, `test-wrong-job` and `test-deep-reply` are a hostile worker: each writes
its own frame straight to the socket its worker holds (the descriptor its command line's config
names), in place of the reply, then waits to be killed. `test-show-worker` reports what its process
can see of its environment and its limits; `test-pid` its pid; `test-spin` burns CPU for ever.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import struct
import sys
import time

from rollart.rewards import ScoreInput, ScoreOutput, register_reward
from rollart.rewards.wire import MAX_REPLY_BYTES, Done, reply_encoder
from rollart.workers.framing import frame


class PlantMarker:
    """Unpickling this creates the file `path`: code run by whoever calls `pickle.loads` on it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def hostile_pickle_frame(marker: str) -> bytes:
    """A frame whose payload, unpickled, would create `marker`."""
    return frame(pickle.dumps(PlantMarker(marker)))


def _write_to_pool(data: bytes) -> None:
    """Write `data` on the worker's socket to the pool, then wait for the pool to kill this worker."""
    fd = json.loads(sys.argv[2])["fd"]  # the worker's config: python -c BOOTSTRAP PATH CONFIG
    os.write(fd, data)
    time.sleep(60)


def hostile_pickle(item: ScoreInput) -> ScoreOutput:
    _write_to_pool(hostile_pickle_frame(item.meta["marker"]))
    raise AssertionError("not killed")


def oversized_reply(item: ScoreInput) -> ScoreOutput:
    _write_to_pool((MAX_REPLY_BYTES + 1).to_bytes(4, "big"))
    raise AssertionError("not killed")


def wrong_job(item: ScoreInput) -> ScoreOutput:
    _write_to_pool(frame(reply_encoder.encode(Done(10**9, ScoreOutput(reward=1.0)))))
    raise AssertionError("not killed")


def deep_reply(item: ScoreInput) -> ScoreOutput:
    """A `Done` for job 0 whose details nest 5000 lists deep: past Python's recursion limit to decode."""
    output = b"\x82\xa6reward\xcb" + struct.pack(">d", 1.0) + b"\xa7details\x81\xa1a" + b"\x91" * 5000 + b"\xc0"
    _write_to_pool(frame(b"\x93\xa4done\x00" + output))
    raise AssertionError("not killed")


def show_worker(item: ScoreInput) -> ScoreOutput:
    with open("/proc/self/environ", "rb") as f:
        raw = f.read().decode(errors="replace")
    limits = {
        "cpu": resource.getrlimit(resource.RLIMIT_CPU),
        "as": resource.getrlimit(resource.RLIMIT_AS),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
    }
    return ScoreOutput(reward=1.0, details={"os_environ": sorted(os.environ), "proc_environ": raw, "limits": limits})


def pid(item: ScoreInput) -> ScoreOutput:
    return ScoreOutput(reward=1.0, details={"pid": os.getpid(), "cpu_s": time.process_time()})


def spin(item: ScoreInput) -> ScoreOutput:
    """Burn CPU until `meta["cpu_s"]` seconds of it are spent by the process (for ever without it)."""
    until = float(item.meta.get("cpu_s", "inf"))
    while time.process_time() < until:
        pass
    return ScoreOutput(reward=1.0, details={"pid": os.getpid()})


register_reward("test-hostile-pickle", hostile_pickle, overwrite=True)
register_reward("test-oversized-reply", oversized_reply, overwrite=True)
register_reward("test-wrong-job", wrong_job, overwrite=True)
register_reward("test-deep-reply", deep_reply, overwrite=True)
register_reward("test-show-worker", show_worker, overwrite=True)
register_reward("test-pid", pid, overwrite=True)
register_reward("test-spin", spin, overwrite=True)
