"""The CPU cores a node process was given (`$ROLLART_CPUS`, set by the local launcher:
`rollart.launch.placement`), as Linux writes a CPU list (`0-3,6`).

A node pins itself at start (`pin_from_env`), except a vLLM generator: its engine's start is three
processes importing torch and vLLM (40-50 s on one core, two engines sharing it), while the
trainer's cores sit idle; it starts on every core and settles on its own once the engine is up
(`pin_tree`: itself, its engine's processes and all their threads). The engine's compute threads
are bound to its cores from the start (`VLLM_CPU_OMP_THREADS_BIND`)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from rollart.errors import ConfigError

ENV = "ROLLART_CPUS"


def cpu_list(cores: Iterable[int]) -> str:
    """Cores as Linux writes a CPU list: runs as ranges (`0-3,6`)."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,6` -> (0, 1, 2, 3, 6); a clear error for anything else."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ConfigError(f"{ENV}={text!r}: expected a CPU list such as 0-3,6") from None
    if not cores or min(cores) < 0:
        raise ConfigError(f"{ENV}={text!r}: expected a CPU list such as 0-3,6")
    return tuple(sorted(cores))


def pin_tree(cores: tuple[int, ...], pid: int | None = None) -> int:
    """Pin every thread of process `pid` (this one by default) and of all its descendants to `cores`;
    how many threads were pinned. A thread or process that ended meanwhile is skipped."""
    pinned, root = 0, os.getpid() if pid is None else pid
    try:
        threads = os.listdir(f"/proc/{root}/task")
    except FileNotFoundError:
        return 0
    for tid in threads:
        try:
            os.sched_setaffinity(int(tid), cores)
            pinned += 1
            with open(f"/proc/{root}/task/{tid}/children") as listing:
                children = [int(child) for child in listing.read().split()]
        except (ProcessLookupError, FileNotFoundError):
            continue
        for child in children:
            pinned += pin_tree(cores, child)
    return pinned


def pin_from_env() -> tuple[int, ...] | None:
    """Pin this process (and what it starts later) to `$ROLLART_CPUS`; its cores, or None when unset."""
    text = os.environ.get(ENV)
    if not text:
        return None
    cores = parse_cpu_list(text)
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:  # a core this machine does not have, or this process may not use
        raise ConfigError(f"{ENV}={text!r}: cannot run on those cores ({exc.strerror})") from None
    return cores


def check_from_env() -> tuple[int, ...] | None:
    """`pin_from_env`'s checks (a clear error for cores this process may not use) without staying
    pinned: for a node that pins itself later (`pin_tree`)."""
    before = os.sched_getaffinity(0)
    cores = pin_from_env()
    os.sched_setaffinity(0, before)
    return cores


def per_worker(cores: tuple[int, ...], workers: int) -> list[tuple[int, ...]]:
    """`cores` split into `workers` contiguous shares, as even as they go (a tensor-parallel engine's workers on
    CPU, one share each). With fewer cores than workers, the workers take turns over them: each share is one core,
    and some cores are shared, which runs but decodes several times slower than a core each."""
    if workers < 1 or not cores:
        raise ValueError(f"{len(cores)} cores for {workers} workers")
    if len(cores) < workers:
        return [(cores[i % len(cores)],) for i in range(workers)]
    base, extra = divmod(len(cores), workers)
    shares, start = [], 0
    for i in range(workers):
        end = start + base + (i < extra)
        shares.append(cores[start:end])
        start = end
    return shares
