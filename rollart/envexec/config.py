"""`EnvWorkersSpec`: the topology's `run.rollout.env_workers`, where env code runs and under what limits.

Beside what it configures (`EnvOpener`, `EnvWorkerPool`); part of `RolloutSpec`, checked where the
topology is loaded. Imports msgspec and the sandbox's spec alone, so the topology loads without the
execution subsystem.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rollart.workers.sandbox import SandboxSpec

Isolation = Literal["auto", "process", "thread"]
"""Where blocking envs run; see `EnvWorkersSpec.isolation` and `rollart.envexec.opener`."""


class EnvWorkersSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Where env code runs: env worker processes with resource limits, or the env-host itself
    (`rollart.envexec.opener`, `rollart.envexec.pool`; docs/envs.md)."""

    isolation: Isolation = "auto"
    """auto: envs of run.env_modules and the gem:/gym: families in worker processes, RollArt's
    built-ins in threads of the env-host; process: every blocking env in worker processes; thread:
    every env in the env-host (no isolation). Simulated envs (`sim`) run on the event loop in all."""
    processes: int = 4
    """Worker processes per env-host; each hosts many envs, and a hung or crashed env ends the others in its worker."""
    cpu_time_s: int = 60
    """CPU seconds of one worker over its life (RLIMIT_CPU); a worker past half of it is replaced."""
    memory_mb: int = 4096
    """Address space of one worker in MiB (RLIMIT_AS): its interpreter, the env modules, its envs."""
    open_files: int = 1024
    """Open file descriptors of one worker (RLIMIT_NOFILE)."""
    pass_env: list[str] = []
    """Environment variables passed to workers although their names look like credentials (an env's
    own API key); never run.secret_env or run.admin_token_env."""
    sandbox: SandboxSpec = SandboxSpec()
    """The workers' sandbox (`rollart.workers.sandbox`): namespaces of their own, no network unless it
    says so, a read-only root and a private scratch directory."""
    python: str | None = None
    """Another Python for the workers (a virtual environment's `bin/python`), so an env package's pins
    (gem-llm's msgspec==0.19) stay out of the node's; it needs msgspec and structlog, and gets the
    project's import paths ahead of its own. None: the node's."""

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs for values that are well-typed but unusable."""
        lows = (("processes", 1), ("cpu_time_s", 1), ("memory_mb", 128), ("open_files", 16))
        problems = [
            (key, f"expected an integer >= {low}; got {getattr(self, key)}")
            for key, low in lows
            if getattr(self, key) < low
        ]
        return problems + [(f"sandbox.{key}", problem) for key, problem in self.sandbox.validate()]
