"""What a worker process is given and how its end is told: its environment, its limits, its exit.

The environment a worker starts with is its node's without the node's credentials
(`child_environ`); its limits are `WorkerLimits`, set by the worker itself with `set_limits`
(`resource.setrlimit`) before it imports any user code; `exit_cause` turns its exit status into
words that name the limit it hit. Env workers and reward workers share all of it.

Limits are per worker, as the kernel keeps them: `memory_mb` is the address space of the
interpreter, the user's modules and every thread's stack (`RLIMIT_AS`); `open_files` counts every
descriptor of the process (`RLIMIT_NOFILE`); `cpu_time_s` is CPU time summed over the worker's
life (`RLIMIT_CPU`), and each pool retires a worker at half of it. A spinning call is stopped by
its deadline first; the CPU limit catches what no deadline sees (threads user code leaves running,
native code on many cores, a reward function that never returns).
"""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterable, Mapping

import msgspec

_SECRET_WORDS = ("SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE")
"""A variable whose name contains one of these is taken for a credential..."""
_SECRET_PARTS = frozenset({"TOKEN", "KEY", "APIKEY", "AUTH", "PAT"})
"""... and so is one with one of these as a `_`-separated part (`HF_TOKEN`, not `TOKENIZERS_PARALLELISM`)."""

CPU_HARD_EXTRA_S = 5
"""The hard CPU limit (SIGKILL) lies this far past the soft one (SIGXCPU), for code that catches SIGXCPU."""


def looks_secret(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential (or RollArt's own settings)."""
    upper = name.upper()
    return (
        upper.startswith("ROLLART_")
        or any(word in upper for word in _SECRET_WORDS)
        or not _SECRET_PARTS.isdisjoint(upper.split("_"))
    )


def child_environ(environ: Mapping[str, str], *, drop: Iterable[str] = (), keep: Iterable[str] = ()) -> dict[str, str]:
    """The environment workers start with: `environ` without the node's secrets.

    Dropped: every name in `drop` (a node passes `run.secret_env` and `run.admin_token_env`;
    nothing brings those back), every `ROLLART_*` variable, and every name that `looks_secret`
    (`AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`, `OPENAI_API_KEY`, `SSH_AUTH_SOCK`, ...) unless it is in
    `keep` (`pass_env` of `run.rollout.env_workers` or `run.reward_pool`, for user code that needs
    its own service's key). `MALLOC_ARENA_MAX=2` is added unless set: glibc otherwise reserves
    64 MiB of address space for each thread that allocates, and the memory limit counts address space.
    """
    dropped = set(drop)
    kept = set(keep) - dropped
    env = {k: v for k, v in environ.items() if k not in dropped and (k in kept or not looks_secret(k))}
    env.setdefault("MALLOC_ARENA_MAX", "2")
    return env


class WorkerLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Resource limits of one worker process, for the whole process (everything it hosts or runs)."""

    cpu_time_s: int = 60
    """CPU seconds over the worker's life (RLIMIT_CPU: SIGXCPU, then SIGKILL 5 s later); its pool
    replaces a worker past half of it."""
    memory_mb: int = 4096
    """Address space in MiB (RLIMIT_AS): the interpreter, the user's modules, every thread's stack."""
    open_files: int = 1024
    """Open file descriptors (RLIMIT_NOFILE), the worker's own few included."""

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs for values that are well-typed but unusable."""
        lows = (("cpu_time_s", 1), ("memory_mb", 128), ("open_files", 16))
        return [
            (key, f"expected an integer >= {low}; got {getattr(self, key)}")
            for key, low in lows
            if getattr(self, key) < low
        ]


def set_limits(limits: WorkerLimits) -> None:
    """Set the calling process's limits, soft and hard alike, so that user code cannot raise them again
    (in the worker, before it imports user code); no core files."""

    def limit(which: int, soft: int, hard: int) -> None:
        current_hard = resource.getrlimit(which)[1]
        if current_hard != resource.RLIM_INFINITY:  # never above what the node itself may use
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (soft, hard))

    limit(resource.RLIMIT_CORE, 0, 0)
    limit(resource.RLIMIT_CPU, limits.cpu_time_s, limits.cpu_time_s + CPU_HARD_EXTRA_S)
    limit(resource.RLIMIT_AS, limits.memory_mb * 2**20, limits.memory_mb * 2**20)
    limit(resource.RLIMIT_NOFILE, limits.open_files, limits.open_files)


def exit_cause(code: int | None, limits: WorkerLimits) -> str:
    """How a worker ended, in words, naming the limit its signal points to; `code` as `Popen.returncode`."""
    if code is None:
        return "it did not exit after SIGKILL"
    if code >= 0:
        return f"exited with code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"killed by signal {-code}"
    hints = {
        signal.SIGXCPU: f"cpu_time_s {limits.cpu_time_s} exceeded",
        signal.SIGKILL: "the cpu_time_s hard limit, the kernel's OOM killer, or another process",
        signal.SIGSEGV: "a crash in native code",
        signal.SIGBUS: "a crash in native code",
        signal.SIGABRT: "an abort in native code",
    }
    return f"killed by {sig.name}" + (f" ({hints[sig]})" if sig in hints else "")
