"""The modules whose CPU time counts as scheduling in the benchmarks that profile it (`scheduler.py`,
`paper/scale.py`): who runs next and where, not what runs."""

from __future__ import annotations

from pathlib import Path

ROLLOUT = Path(__file__).resolve().parents[1] / "rollart" / "rollout"

SCHEDULING_FILES = (
    "rollart/rollout/dispenser.py",
    "rollart/rollout/buffer.py",
    "rollart/rollout/staleness.py",
    "rollart/rollout/versions.py",
    "rollart/rollout/proxy.py",
    *sorted(f"rollart/rollout/routing/{path.name}" for path in (ROLLOUT / "routing").glob("*.py")),
)
"""Paths as a profile's file names end (`str.endswith` takes the tuple)."""
