"""The machine line every benchmark report starts with (run as scripts, the benchmarks import it as a sibling)."""

from __future__ import annotations

import contextlib
import os
import platform
from importlib.metadata import version
from pathlib import Path


def describe(packages: list[str], extra: str = "") -> str:
    """CPU count and model, OS, Python, the versions of `packages`, `extra`, and the load average now."""
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    parts = [f"Python {platform.python_version()}", *(f"{name} {version(name)}" for name in packages)]
    if extra:
        parts.append(extra)
    return (
        f"nproc {len(os.sched_getaffinity(0))} ({model}), {platform.system()} {platform.machine()}, "
        f"{', '.join(parts)}; load average at start {load}"
    )
