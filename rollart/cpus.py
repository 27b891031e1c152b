"""The CPU cores a node process was given (`$ROLLART_CPUS`, set by the local launcher:
`rollart.launch.placement`), as Linux writes a CPU list (`0-3,6`)."""

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
