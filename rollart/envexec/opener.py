"""EnvOpener: where each task's envs run, by the isolation setting, and opening them there.

Three places (`Placement`):
- `loop`: on the event loop itself, for envs whose calls return at once (`blocking = False`: `sim`);
- `thread`: a worker thread of the env-host (`EnvRunner`): fastest, but a hung env keeps its
  thread, and the env shares the node's memory and environment;
- `process`: an env worker process (`EnvWorkerPool`, `WorkerEnvRunner`): killed when a call
  hangs, under CPU, memory and open-file limits, without the node's secrets.

The isolation setting (`run.rollout.env_workers.isolation`) picks:
- `auto` (the default): `process` for code that is not RollArt's: envs registered by
  `run.env_modules` (or built-ins they replaced) and the `gem:` / `gym:` families, which run
  third-party packages, and the built-ins that run the model's programs (`code`); RollArt's other
  built-ins stay in the env-host, where a call (one
  trajectory at a time) costs about two thirds of the CPU it does through a worker
  (`benchmarks/results/envs.md`), and the local run steps them by the thousand.
- `process`: every blocking env in a worker process, the built-ins too.
- `thread`: every env in the env-host, as before worker processes existed (no isolation).
Non-blocking envs (`sim`) run on the loop in every mode: they never block and keep the
simulation's virtual time. A wrapper built-in (`flaky`, `slow`) counts as the env it wraps.

Outside `thread` mode the env-host never imports `run.env_modules` itself: the workers do, and
say which names the modules registered, so user code never runs in the node's process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from rollart.clock import SimClock
from rollart.envexec.config import Isolation
from rollart.envexec.pool import EnvWorkerPool
from rollart.envexec.runner import EnvRunner
from rollart.envs.base import EnvFailure, Profile
from rollart.envs.handle import EnvHandle
from rollart.envs.registry import import_env_modules, make_env, registered_factories
from rollart.errors import ConfigError

Placement = Literal["loop", "thread", "process"]

PROBE_TIMEOUT_S = 60.0
"""Deadline of building one env of each task in a worker at start-up, to learn its profile and turns."""


@dataclass(frozen=True)
class EnvTraits:
    """What the env-host learns of a task's env before running it."""

    placement: Placement
    profile: Profile
    max_turns: int


RUNS_MODEL_CODE = frozenset({"code"})
"""Built-ins that run what the model wrote (`code`): in worker processes, in their sandbox, under `auto`."""


def is_builtin(name: str, kwargs: Mapping[str, Any], user_envs: frozenset[str] = frozenset()) -> bool:
    """Whether `make_env(name, **kwargs)` runs RollArt's own code only: a name RollArt registered,
    not replaced by an env module (`user_envs`), and wrapping (`inner=`) only such envs."""
    if ":" in name or name in user_envs or name in RUNS_MODEL_CODE:  # families run third-party packages
        return False
    factory = registered_factories().get(name)
    if factory is None or not getattr(factory, "__module__", "").startswith("rollart."):
        return False
    inner = kwargs.get("inner")
    return not isinstance(inner, str) or is_builtin(inner, {}, user_envs)


class EnvOpener:
    """Opens the envs of named tasks where `isolation` puts them; owns the env worker pool."""

    def __init__(
        self,
        isolation: Isolation,
        *,
        env_modules: list[str],
        pool: EnvWorkerPool | None = None,
        clock: SimClock | None = None,
    ) -> None:
        """`pool`: the (not yet started) pool for `process` envs; started only if some task needs it."""
        self.isolation = isolation
        self.env_modules = env_modules
        self.pool = pool if pool is not None else EnvWorkerPool(env_modules=env_modules)
        self.clock = clock or SimClock()
        self.traits: dict[str, EnvTraits] = {}
        self._envs: dict[str, tuple[str, dict[str, Any]]] = {}
        self._pool_started = False

    async def prepare(self, envs: Mapping[str, tuple[str, dict[str, Any]]]) -> dict[str, EnvTraits]:
        """Place each task's env (`{task: (env name, kwargs)}`), starting the pool if some need it,
        and learn each one's traits by building one. `ConfigError` for an env that cannot be built."""
        self._envs = dict(envs)
        user_envs: frozenset[str] = frozenset()
        if self.isolation == "thread":
            import_env_modules(self.env_modules)
        elif self.env_modules or any(not is_builtin(name, kwargs) for name, kwargs in envs.values()):
            await self._start_pool()  # its workers import the modules and say what they registered
            user_envs = self.pool.user_envs
        for task, (name, kwargs) in self._envs.items():
            if self.isolation == "thread" or is_builtin(name, kwargs, user_envs):
                env = make_env(name, **kwargs)  # RollArt's own code (or, in thread mode, trusted by choice)
                where: Placement = "process" if self.isolation == "process" else "thread"
                self.traits[task] = EnvTraits("loop" if not env.blocking else where, env.profile, env.max_turns)
                env.close()
            else:
                self.traits[task] = await self._probe(task, name, kwargs)
        if any(t.placement == "process" for t in self.traits.values()):
            await self._start_pool()
        return dict(self.traits)

    async def open(self, task: str, *, timeout_s: float) -> EnvHandle:
        """A fresh env of `task`, where it was placed, with `timeout_s` per call."""
        name, kwargs = self._envs[task]
        match self.traits[task].placement:
            case "process":
                return await self.pool.open(name, kwargs, timeout_s=timeout_s, clock=self.clock)
            case "thread":
                env = await asyncio.to_thread(make_env, name, **kwargs)
            case "loop":
                env = make_env(name, **kwargs)
        return EnvRunner(env, name=name, timeout_s=timeout_s, clock=self.clock)

    async def close(self) -> None:
        """Stop the env worker processes (each trajectory has closed its env by now, or abandoned it)."""
        await self.pool.close()

    def status(self) -> dict[str, Any]:
        placement = {task: traits.placement for task, traits in self.traits.items()}
        status: dict[str, Any] = {
            "isolation": self.isolation,
            "placement": placement,
            "runs_in": self.pool.launch.described,
        }
        if self._pool_started:
            status["workers"] = self.pool.stats()
        return status

    async def _start_pool(self) -> None:
        if not self._pool_started:
            self._pool_started = True
            await self.pool.start()

    async def _probe(self, task: str, name: str, kwargs: dict[str, Any]) -> EnvTraits:
        try:
            runner = await self.pool.open(name, kwargs, timeout_s=PROBE_TIMEOUT_S)
            await runner.close()
        except EnvFailure as exc:
            raise ConfigError(f"task {task!r}: env {name!r} cannot be built in an env worker: {exc}") from exc
        if runner.profile not in ("prefill-heavy", "decode-heavy"):
            raise ConfigError(f"task {task!r}: env {name!r} has profile {runner.profile!r}; expected an Env.profile")
        return EnvTraits("process", cast(Profile, runner.profile), runner.max_turns)
