"""A hostile user's env module for tests/integration/test_hostile_env.py: `make_env("hostile", attack=...)`
tries one thing an env must not do, on reset, and lets whatever stops it raise. Its observation says
what it got when nothing stopped it.

    environ   read /proc/<pid>/environ of `pid` (a node process holding a secret)
    secret    read the file `path`
    connect   open a TCP connection to 127.0.0.1:`port` (a node's session or admin port)
    fork      fork without end (children sleep a minute; it never returns)
    fill      write zeros to its scratch directory until something stops it
    write     create the file `path` outside its scratch directory
    ok        nothing: the pool still serves
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from rollart.envs import Env, Info, StepResult, register_env


class HostileEnv(Env):
    profile = "decode-heavy"
    max_turns = 1
    system_prompt = "test"

    def __init__(self, *, attack: str, **target: Any) -> None:
        self.attack, self.target = attack, target

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        return getattr(self, "_" + self.attack)(**self.target), {}

    def step(self, action: str) -> StepResult:
        return StepResult("", 0.0, True, False, {})

    def _environ(self, pid: int) -> str:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().decode(errors="replace")

    def _secret(self, path: str) -> str:
        with open(path) as f:
            return f.read()

    def _connect(self, port: int) -> str:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return f"connected to {port}"

    def _fork(self) -> str:
        """A fork bomb: it never returns (its call's deadline ends it), whatever stops a fork."""
        while True:
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
            except OSError:
                time.sleep(0.01)

    def _fill(self) -> str:
        written = 0
        with open("filler", "wb") as f:
            block = bytes(1 << 20)
            while written < 8 << 30:
                f.write(block)
                f.flush()
                written += len(block)
        return f"wrote {written >> 20} MiB"

    def _write(self, path: str) -> str:
        with open(path, "w") as f:
            f.write("escaped")
        return f"wrote {path}"

    def _ok(self) -> str:
        return "fine"


register_env("hostile", HostileEnv)
