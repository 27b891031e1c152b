"""Envs for the env worker tests: a user's module, imported by the workers through `env_modules`.

`make_env("test-worker", on_step=...)` plays two-step episodes and misbehaves on its first step
the way `on_step` says: "ok" (it does not), "raise", "hang", "exit" (`os._exit(3)`), "segfault"
(reads address 0), "spin" (burns CPU for ever), "burn" (burns CPU until its process has used
1.2 s), "allocate" (1 GiB), "open-files" (100 files, kept open), "lie" (its worker answers the
step with a `Closed` reply: a broken worker, see `_lying_call` below), "deep" (writes a step reply
whose info nests 5000 lists deep straight to its worker's socket, then hangs: a hostile worker).
Its reset's info carries its pid; with `show_environ=True` its observation is a JSON list of what
the process can see of its environment: `os.environ`'s names and `/proc/self/environ`.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
import time
from typing import Any

from rollart.envexec import worker as worker_module
from rollart.envexec.wire import CallReply, Close, Closed, Make, Reset, Step
from rollart.envs import Env, Info, StepResult, register_env
from rollart.workers.framing import frame


class WorkerTestEnv(Env):
    profile = "decode-heavy"
    max_turns = 2
    system_prompt = "test"

    def __init__(self, *, on_step: str = "ok", show_environ: bool = False) -> None:
        self.on_step = on_step
        self.show_environ = show_environ
        self.turns = 0
        self.kept: list[Any] = []

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        self.turns = 0
        obs = "go"
        if self.show_environ:
            with open("/proc/self/environ", "rb") as f:
                raw = f.read().decode(errors="replace")
            obs = json.dumps({"os_environ": sorted(os.environ), "proc_environ": raw})
        return obs, {"pid": os.getpid(), "seed": seed}

    def step(self, action: str) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            self._misbehave()
        done = self.turns >= self.max_turns
        return f"you said {action}", 1.0, done, False, {"pid": os.getpid(), "answer": action}

    def _misbehave(self) -> None:
        match self.on_step:
            case "raise":
                raise ValueError("boom")
            case "hang":
                time.sleep(3600)
            case "exit":
                os._exit(3)
            case "segfault":
                ctypes.string_at(0)  # reads address 0: SIGSEGV in this very thread
            case "spin":
                while True:
                    pass
            case "burn":
                while time.process_time() < 1.2:
                    pass
            case "allocate":
                self.kept.append(bytearray(2**30))
            case "open-files":
                self.kept += [open(os.devnull) for _ in range(100)]  # noqa: SIM115 - kept open on purpose
            case "deep":
                info = b"\x81\xa1a" + b"\x91" * 5000 + b"\xc0"
                reply = b"\x97\xa9step-done\x00\xa0\xcb" + struct.pack(">d", 1.0) + b"\xc2\xc2" + info
                os.write(json.loads(sys.argv[2])["fd"], frame(reply))  # the worker's config names its socket
                time.sleep(3600)


register_env("test-worker", WorkerTestEnv)

_honest_call = worker_module.EnvHost.call


def _lying_call(self: worker_module.EnvHost, request: Make | Reset | Step | Close) -> CallReply:
    """The worker's own call, except that the step of a `on_step="lie"` env is answered with a
    `Closed` reply: what a broken (or hostile) worker could send. Affects the worker processes
    only, which import this module; the env-host never runs `EnvHost`."""
    reply = _honest_call(self, request)
    env = self.envs.get(request.env)
    if isinstance(request, Step) and isinstance(env, WorkerTestEnv) and env.on_step == "lie":
        return Closed(request.call, reply.cpu_s)
    return reply


worker_module.EnvHost.call = _lying_call  # type: ignore[method-assign]
